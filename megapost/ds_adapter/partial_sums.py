"""Gradients that are partial sums over a process group (the sequence-parallel norm gains over the
tensor-parallel group, ``megapost.parallel.layers.defer_sequence_parallel_reduction``) summed once per
optimizer step, in one all-reduce, on DeepSpeed's reduced gradients: the views its optimizers step from
(``fragments.reduced_grad``: the fp32 buffers of the bf16 optimizer, ZeRO-1/2's partitions, or
``param.grad`` on the fp32 ZeRO-0 path), after the data-parallel reduction and before anything reads
them (the trainer's ``before_optimizer_step``, the norm, the clip, the step). The tensor- and
data-parallel sums commute; every rank of the group holds the same layout (the same shapes, so the
same flat buffers and partitions), hence the same views in the same order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapost.ds_adapter import fragments


def reduce_once(params: Sequence[nn.Parameter], group: Any) -> int:
    """Sum the reduced gradients of ``params`` over ``group`` in place, one all-reduce of their
    concatenation; returns the number of elements reduced (0: no collective, on every rank of the
    group alike)."""
    views = [v for v in (fragments.reduced_grad(p) for p in params) if v is not None and v.numel()]
    if not views:
        return 0
    flat = torch.cat([v.reshape(-1) for v in views])
    dist.all_reduce(flat, group=group)
    with torch.no_grad():
        for view, part in zip(views, flat.split([v.numel() for v in views]), strict=True):
            view.copy_(part.view_as(view))
    return flat.numel()
