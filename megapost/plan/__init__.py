"""The memory and throughput planner (``python -m megapost.plan``): what fits where, and how fast."""

from __future__ import annotations

from typing import Any

import torch

from megapost.config.resolved import DataConfig, RuntimeConfig
from megapost.kernels.linear_ce import CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS
from megapost.model import ModelConfig
from megapost.model.fusion import parse_fusion
from megapost.model.loss import BLOCK_ELEMENTS, DEFAULT_BLOCK_ELEMENTS
from megapost.plan.counts import ParameterCounts, parameter_counts
from megapost.plan.memory import Layout, Precision, RankMemory, rank_memory, stage_memory

__all__ = ["Layout", "ParameterCounts", "Precision", "RankMemory", "parameter_counts", "planned_rank_peak",
           "precision_from_ds_config", "rank_memory", "stage_memory"]


def precision_from_ds_config(ds_config: dict[str, Any], fused_adam: bool = True,
                             norm_kernel: str = "fused",
                             loss_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
                             packed: bool = True, chunked_ce: bool | None = None,
                             ce_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> Precision:
    """The settings of a (generated) DeepSpeed config that change memory."""
    zero = ds_config.get("zero_optimization", {})
    return Precision(
        bf16=bool(ds_config.get("bf16", {}).get("enabled", False)),
        reduce_bucket_size=int(zero.get("reduce_bucket_size", Precision.reduce_bucket_size)),
        overlap_comm=bool(zero.get("overlap_comm", False)),
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        fused_adam=fused_adam, norm_kernel=norm_kernel, loss_block_elements=loss_block_elements,
        packed=packed, chunked_ce=chunked_ce, ce_chunk_elements=ce_chunk_elements,
    )


def planned_rank_peak(cfg: ModelConfig, data: DataConfig, runtime: RuntimeConfig, pstate: Any,
                      ds_config: dict[str, Any]) -> int:
    """The planner's peak bytes for this rank of a built run (its pipeline stage)."""
    layout = Layout(pstate.tp_size, pstate.pp_size, pstate.dp_size, ds_config["zero_optimization"]["stage"],
                    data.micro_batch_size, data.grad_accum_steps, runtime.checkpoint_activations,
                    pstate.sequence_parallel, runtime.checkpoint_num_layers)
    cuda = torch.cuda.is_available()  # megapost.optim.optimizer builds fused AdamW on every device
    from megapost.model.norm import _ApexRMSNorm

    kernel = ("apex" if _ApexRMSNorm is not None else "fused") if cuda else "composite"
    block = BLOCK_ELEMENTS.get("cuda" if cuda else "cpu", DEFAULT_BLOCK_ELEMENTS)
    packed = runtime.kernel_fusion == "auto"  # an explicit --kernel-fusion list: priced unpacked
    fusion = parse_fusion(runtime.kernel_fusion)
    chunked = None if fusion.names is None else "ce" in fusion.names  # None: auto, outside fp32
    chunk = CHUNK_ELEMENTS.get("cuda" if cuda else "cpu", DEFAULT_CHUNK_ELEMENTS)
    prec = precision_from_ds_config(ds_config, norm_kernel=kernel, loss_block_elements=block, packed=packed,
                                    chunked_ce=chunked, ce_chunk_elements=chunk)
    return stage_memory(cfg, layout, prec, pstate.pp_rank).peak
