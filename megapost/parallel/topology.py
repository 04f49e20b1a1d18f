"""Process groups for (pipeline, data, tensor) parallelism, taken from DeepSpeed's own grid.

Ranks follow ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``, axes ['pipe', 'data', 'model']
with 'model' (tensor parallelism) varying fastest: the TP ranks of a stage are adjacent global ranks,
as in Megatron. The groups are those of a ``PipelineParallelGrid`` over that topology, so they agree
with what DeepSpeed's ``PipelineModule`` builds from the same topology: the TP group is the grid's
slice group, DP its data-parallel group, PP its pipe group.
"""

from __future__ import annotations

import torch.distributed as dist

from megapost.ds_adapter.internals import pipeline_grid
from megapost.parallel.layout import PP_FLAG, TP_FLAG
from megapost.parallel.state import ParallelState


def initialize_parallel(tp: int = 1, pp: int = 1, sequence_parallel: bool = False) -> ParallelState:
    """This rank's ParallelState (the caller owns it and passes it down).

    Call after ``deepspeed.init_distributed(dist_backend=...)``, collectively on every rank. Without an
    initialised process group only the single-process layout (1, 1) is accepted. Sequence parallelism
    is recorded only when ``tp > 1`` (it is a no-op on one tensor-parallel rank).
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if tp < 1 or pp < 1:
        raise ValueError(f"{TP_FLAG} ({tp}) and {PP_FLAG} ({pp}) must be >= 1")
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by {TP_FLAG} {tp} x {PP_FLAG} {pp}")
    sp = sequence_parallel and tp > 1
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return ParallelState(sequence_parallel=sp)
    topology, grid = pipeline_grid(pp, tp, world // (tp * pp))
    coord = topology.get_coord(dist.get_rank())
    state = ParallelState(
        tp_size=tp, pp_size=pp, dp_size=world // (tp * pp),
        tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=coord.data,
        tp_group=grid.get_slice_parallel_group(), pp_group=grid.get_pipe_parallel_group(),
        dp_group=grid.get_data_parallel_group(),
        sequence_parallel=sp, topology=topology, grid=grid,
    )
    return state
