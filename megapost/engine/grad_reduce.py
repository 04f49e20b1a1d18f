"""How data-parallel gradients are reduced: overlapped with backward (ZeRO-1/2 ``overlap_comm``), in
contiguous buckets sized from the model, in fp32 unless ``--grad-reduce-in-bf16``.

DeepSpeed routes ``--bf16`` at ZeRO stage 1 with fp32 accumulation to its BF16 optimizer, which
all-reduces every gradient in one bucketed pass after the last micro-batch's backward: nothing
overlaps. Its ZeRO optimizer (stage 2 for bf16; 1 or 2 for fp32) reduces a bucket from inside the
backward hooks as soon as it fills (stage 1: on the last micro-batch of a step), with fp32
accumulation of bf16 gradients (``grad_accum_dtype``). So overlapping a bf16 run means stage 2, which
also partitions the gradients (less memory, the same update). That choice (stage, overlap, notes) is
made when the configuration is resolved (megapost.config.resolved.grad_reduction); this module applies
it to DeepSpeed's config.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from megapost.config.resolved import EngineConfig

MEGATRON_BUCKET = 40_000_000  # Megatron-LM's DDP bucket (elements)
MIN_BUCKETS = 8  # a model smaller than 8 Megatron buckets is still cut into 8, so reduction overlaps


def bucket_elements(model: nn.Module) -> int:
    """Megatron's 40M-element bucket, or 1/8 of this rank's parameters when that is smaller."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(1, min(MEGATRON_BUCKET, math.ceil(total / MIN_BUCKETS)))


def configure_grad_reduction(config: dict[str, Any], engine: EngineConfig, model: nn.Module) -> list[str]:
    """Set the reduction keys of the DeepSpeed ``config`` as ``engine`` resolved them (stage, overlap:
    megapost.config.resolved.grad_reduction; keys the user's JSON set are kept); returns the start-up
    notes."""
    zero = config.setdefault("zero_optimization", {})
    notes = list(engine.reduce_notes)
    if engine.grad_reduce_in_bf16:
        config["communication_data_type"] = "bf16"
    zero["stage"] = engine.zero_stage
    if engine.bf16 and zero["stage"] == 2:
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    if engine.overlap_grad_reduce:
        bucket = bucket_elements(model)
        zero.setdefault("overlap_comm", True)
        zero.setdefault("contiguous_gradients", True)
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("allgather_bucket_size", bucket)
        notes.append(f"gradient reduction overlapped with backward (ZeRO-{zero['stage']}, buckets of "
                     f"{zero['reduce_bucket_size']:,} elements, "
                     f"{config.get('communication_data_type', 'fp32')})")
    return notes
