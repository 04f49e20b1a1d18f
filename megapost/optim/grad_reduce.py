"""How data-parallel gradients are reduced: once per optimizer step where that moves fewer bytes,
overlapped with backward where asked (``--overlap-grad-reduce``), in contiguous buckets sized from the
model, in fp32 unless ``--grad-reduce-in-bf16``.

DeepSpeed routes ``--bf16`` at ZeRO stage 1 with fp32 accumulation to its BF16 optimizer, which
accumulates every micro-batch's gradients in fp32 and all-reduces them once, in one blocking pass
after the last micro-batch's backward; with overlap megapost's own hooks (megapost.ds_adapter.overlap,
installed by megapost.optim.hooks) all-reduce each bucket of that fp32 buffer asynchronously as soon
as the last micro-batch's backward has produced its gradients, as Megatron-core's DDP does. DeepSpeed's
ZeRO optimizer (fp32 ZeRO-1/2, bf16 ZeRO-2) reduces a bucket from inside the backward hooks as soon as
it fills (``overlap_comm``): at stage 1 only on the last micro-batch of a step, at stage 2 on every
micro-batch (m times the bytes of one reduction). So a bf16 run reduces once per step at ZeRO-1 and
runs ZeRO-2 only at one micro-batch per step (the same bytes) or when ``--zero-stage 2`` asks
(megapost.parallel.reduce_bytes). That choice (stage, overlap, notes) is made when the configuration
is resolved (megapost.config.resolved.grad_reduction); this module applies it to DeepSpeed's config,
and names the bytes reduced per step at start-up.
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from megapost.config.resolved import EngineConfig
from megapost.parallel.reduce_bytes import describe, dp_step_bytes

MEGATRON_BUCKET = 40_000_000  # Megatron-LM's DDP bucket (elements)
MIN_BUCKETS = 8  # a model smaller than 8 Megatron buckets is still cut into 8, so reduction overlaps


def bucket_elements(model: nn.Module) -> int:
    """Megatron's 40M-element bucket, or 1/8 of this rank's parameters when that is smaller."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(1, min(MEGATRON_BUCKET, math.ceil(total / MIN_BUCKETS)))


def bf16_overlap(engine: EngineConfig) -> bool:
    """The bf16 ZeRO-1 reduction overlapped by megapost's hooks (megapost.ds_adapter.overlap)."""
    return engine.overlap_grad_reduce and engine.bf16 and engine.zero_stage == 1


def overlap_bucket(config: dict[str, Any], engine: EngineConfig) -> int | None:
    """Elements per bucket of megapost's overlapped bf16 reduction (None: DeepSpeed reduces)."""
    return int(config["zero_optimization"]["reduce_bucket_size"]) if bf16_overlap(engine) else None


def configure_grad_reduction(config: dict[str, Any], engine: EngineConfig, model: nn.Module,
                             dp_size: int = 1) -> list[str]:
    """Set the reduction keys of the DeepSpeed ``config`` as ``engine`` resolved them (stage, overlap:
    megapost.config.resolved.grad_reduction; keys the user's JSON set are kept); returns the start-up
    notes, the last one (DP > 1) the bytes this rank reduces per step (megapost.parallel.reduce_bytes)."""
    zero = config.setdefault("zero_optimization", {})
    notes = list(engine.reduce_notes)
    if engine.grad_reduce_in_bf16:
        config["communication_data_type"] = "bf16"
    zero["stage"] = engine.zero_stage
    if engine.bf16 and zero["stage"] == 2:
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    if engine.overlap_grad_reduce:
        bucket = bucket_elements(model)
        zero.setdefault("reduce_bucket_size", bucket)
        comm = config.get("communication_data_type", "fp32")
        if bf16_overlap(engine):  # read by megapost.ds_adapter.overlap, not by DeepSpeed's optimizer
            notes.append(f"gradient reduction overlapped with the last micro-batch's backward (bf16 ZeRO-1: "
                         f"megapost's hooks on DeepSpeed's bf16 optimizer, buckets of >= "
                         f"{zero['reduce_bucket_size']:,} elements of the fp32 accumulator, all-reduced in "
                         f"{comm})")
        else:
            zero.setdefault("overlap_comm", True)
            zero.setdefault("contiguous_gradients", True)
            zero.setdefault("allgather_bucket_size", bucket)
            notes.append(f"gradient reduction overlapped with backward (ZeRO-{zero['stage']}, buckets of "
                         f"{zero['reduce_bucket_size']:,} elements, {comm})")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reduced = dp_step_bytes(params, dp_size, zero["stage"], engine.batch.grad_accum_steps, engine.bf16,
                            config.get("communication_data_type") == "bf16")
    if reduced.reductions:  # one data-parallel rank: nothing reduced, nothing to say
        notes.append(describe(reduced, zero["stage"], engine.batch.grad_accum_steps))
    return notes
