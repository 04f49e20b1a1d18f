"""The rest of DeepSpeed's internals megapost uses: the pipeline grid behind the process groups, the
balanced layer partition of a pipeline, and the checkpoint engine and pickled classes of its files."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

# Every non-builtin global in the files DeepSpeed writes for megapost (ZeRO 0/1/2, bf16, PP > 1).
CHECKPOINT_GLOBALS: tuple[type, ...] = (LossScaler, ZeroStageEnum, fragment_address)
CheckpointEngineBase = TorchCheckpointEngine


def engine_config(engine: Any) -> Any:
    """The engine's parsed DeepSpeed config (what its checkpoint engine is built from)."""
    return engine._config


def pipeline_grid(pp: int, tp: int, dp: int) -> tuple[Any, Any]:
    """(topology, grid): DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model) and the
    ``PipelineParallelGrid`` of its process groups (collective: every rank calls it)."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    return topology, PipelineParallelGrid(topology=topology)


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` (what ``PipelineModule`` assigns layers with)."""
    from deepspeed.runtime.utils import partition_balanced as balanced

    return balanced(weights, parts)
