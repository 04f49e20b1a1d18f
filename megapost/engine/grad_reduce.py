"""How data-parallel gradients are reduced: overlapped with backward (ZeRO-1/2 ``overlap_comm``), in
contiguous buckets sized from the model, in fp32 unless ``--grad-reduce-in-bf16``.

DeepSpeed routes ``--bf16`` at ZeRO stage 1 with fp32 accumulation to its BF16 optimizer, which
all-reduces every gradient in one bucketed pass after the last micro-batch's backward: nothing
overlaps. Its ZeRO optimizer (stage 2 for bf16; 1 or 2 for fp32) reduces a bucket from inside the
backward hooks as soon as it fills (stage 1: on the last micro-batch of a step), with fp32
accumulation of bf16 gradients (``grad_accum_dtype``). So overlapping a bf16 run means stage 2, which
also partitions the gradients (less memory, the same update).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn

from megapost.config.errors import ConfigError

MEGATRON_BUCKET = 40_000_000  # Megatron-LM's DDP bucket (elements)
MIN_BUCKETS = 8  # a model smaller than 8 Megatron buckets is still cut into 8, so reduction overlaps


def bucket_elements(model: nn.Module) -> int:
    """Megatron's 40M-element bucket, or 1/8 of this rank's parameters when that is smaller."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(1, min(MEGATRON_BUCKET, math.ceil(total / MIN_BUCKETS)))


def overlap_wanted(args: argparse.Namespace, dp_size: int, device: torch.device) -> bool:
    """``--overlap-grad-reduce`` / ``--no-overlap-grad-reduce`` as given; by default on when more than
    one data-parallel rank reduces over GPUs (on CPU/gloo a collective blocks the rank anyway)."""
    if args.overlap_grad_reduce is not None:
        return bool(args.overlap_grad_reduce) and dp_size > 1
    return dp_size > 1 and device.type == "cuda"


def configure_grad_reduction(config: dict[str, Any], args: argparse.Namespace, dp_size: int,
                             device: torch.device, model: nn.Module) -> list[str]:
    """Set the reduction keys of the DeepSpeed ``config`` (keys the user's JSON set are kept); returns
    the start-up notes. Resolves ``args.overlap_grad_reduce`` to what the run does."""
    zero = config.setdefault("zero_optimization", {})
    notes: list[str] = []
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ConfigError("--grad-reduce-in-bf16: needs --bf16 (fp32 gradients are reduced in fp32)")
        config["communication_data_type"] = "bf16"
        notes.append("--grad-reduce-in-bf16: gradients reduced in bf16 (accumulated in fp32)")
    overlap = overlap_wanted(args, dp_size, device)
    if overlap and args.pipeline_model_parallel_size > 1:  # DeepSpeed's pipeline engine: ZeRO <= 1,
        # gradients reduced in its own step after the last micro-batch
        notes.append("--overlap-grad-reduce: not under pipeline parallelism (DeepSpeed's pipeline engine "
                     "reduces after the last micro-batch)")
        overlap = False
    if overlap and args.bf16 and zero.get("stage") == 1:
        if "zero_stage" in args.explicit:
            notes.append("--bf16 --zero-stage 1: gradients reduced after backward, not overlapped "
                         "(DeepSpeed's bf16 ZeRO-1 optimizer); --zero-stage 2 overlaps them")
            overlap = False
        else:
            zero["stage"] = args.zero_stage = 2
            notes.append("--overlap-grad-reduce with --bf16: ZeRO stage 2 (DeepSpeed's bf16 ZeRO-1 "
                         "optimizer cannot overlap)")
    if args.bf16 and zero.get("stage") == 2:
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    if overlap and zero.get("stage", 0) == 0:
        notes.append("--overlap-grad-reduce: ZeRO stage 0 all-reduces after backward; "
                     "use --zero-stage 1 or 2")
        overlap = False
    args.overlap_grad_reduce = overlap
    if overlap:
        bucket = bucket_elements(model)
        zero.setdefault("overlap_comm", True)
        zero.setdefault("contiguous_gradients", True)
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("allgather_bucket_size", bucket)
        notes.append(f"gradient reduction overlapped with backward (ZeRO-{zero['stage']}, buckets of "
                     f"{zero['reduce_bucket_size']:,} elements, "
                     f"{config.get('communication_data_type', 'fp32')})")
    return notes
