"""The one place that answers "which rank am I on each axis" (tensor, pipeline, data): a
``ParallelState`` instance, built by ``megapost.parallel.topology.initialize_parallel`` and passed down
by the trainer's build to the model's parallel layers, the data, the engine and the plugins (no module
global: a process may build several, e.g. tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class ParallelState:
    """Sizes, this rank's coordinates and process groups; groups are None where the axis has size 1
    and no process group was created (single process)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    sequence_parallel: bool = False
    async_tensor_model_parallel_allreduce: bool = True  # megapost.parallel.async_linear (TP > 1)
    topology: Any = None  # deepspeed PipeModelDataParallelTopology when built by initialize_parallel
    grid: Any = None  # deepspeed PipelineParallelGrid that tp/pp/dp_group were taken from

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def is_logging_rank(self) -> bool:
        """The last global rank (last pipeline stage) logs, as in Megatron."""
        return self.global_rank == self.world_size - 1

