"""The model-parallel unit (``mpu``) DeepSpeed asks for in ``deepspeed.initialize(mpu=...)``.

Pass it when the pipeline has one stage (with a ``PipelineModule`` DeepSpeed uses the module's own
grid and rejects an mpu). DeepSpeed then reduces gradients and broadcasts the initial weights over the
data-parallel group only, and in the gradient norm counts a parameter with ``tensor_model_parallel``
on every TP rank and any other parameter on TP rank 0 only, summing over the model-parallel group.

"Model parallel" here means every rank holding a different part of one model replica (pipeline x
tensor, DeepSpeed's convention); with one stage that is the tensor-parallel group. The Ulysses
``get_sequence_parallel_*`` methods are deliberately absent: DeepSpeed would treat Megatron-style
sequence parallelism (which lives inside the TP group) as a separate sequence axis.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megapost.parallel.state import ParallelState


class MPU:
    """Megatron/DeepSpeed mpu interface over a ParallelState built by ``initialize_parallel``."""

    def __init__(self, pstate: ParallelState) -> None:
        if pstate.grid is None:
            raise ValueError("the mpu needs the ParallelState initialize_parallel returns (after init)")
        self.pstate = pstate
        self.grid = pstate.grid

    # one model replica: pipeline x tensor
    def get_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.grid.get_model_parallel_world_size()

    def get_model_parallel_group(self) -> Any:
        return self.grid.get_model_parallel_group()

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self.pstate.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.pstate.dp_size

    def get_data_parallel_group(self) -> Any:
        return self.pstate.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.grid.get_data_parallel_group_ranks())

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.pstate.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.pstate.tp_size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.pstate.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's tensor-parallel group."""
        return dist.get_rank() - self.pstate.tp_rank

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pstate.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pstate.pp_size

    def get_pipeline_model_parallel_group(self) -> Any:
        return self.pstate.pp_group

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group


def make_mpu(pstate: ParallelState) -> MPU:
    """The mpu for ``deepspeed.initialize`` when ``pstate.pp_size == 1``."""
    if pstate.pp_size > 1:
        raise ValueError("with --pipeline-model-parallel-size > 1 DeepSpeed takes the mpu from the "
                         "PipelineModule; pass mpu=None")
    return MPU(pstate)
