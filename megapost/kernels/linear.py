"""Several bias-free projections of one input as one GEMM: y = x [W_1; W_2; ...]^T, split by the
caller (Q/K/V, or W_1/W_3). Forward one GEMM instead of n; backward one GEMM for dx (instead of n and
n-1 adds) and one for the stacked dW, whose row blocks are returned as each weight's gradient (views,
no copy). The weights stay separate parameters (checkpoints, resharding, tensor-parallel shards and
the HF export see the same tensors); the stacked weight is a zero-copy view when they lie back to back
in memory (DeepSpeed's bf16 optimizer flattens the parameters of a group into one buffer in order),
else a ``cat`` per call. Not bit-identical to n separate GEMMs (dx sums over all rows at once).

An input that carries a ``wgrad_sink`` (the tensor-parallel entry of ``megapost.parallel.async_linear``,
which computes the weight gradients while its input-gradient collective is in flight) and whose sink
holds these weights gets the output gradient instead of the stacked dW GEMM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def _adjacent(weights: Sequence[torch.Tensor]) -> bool:
    """Contiguous, same dtype/device/width, and each starting where the previous one ends."""
    first = weights[0]
    if not all(w.is_contiguous() and w.dtype == first.dtype and w.device == first.device
               and w.shape[1:] == first.shape[1:] for w in weights):
        return False
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset:
            return False
        offset += w.numel()
    return True


def packed_weight(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights stacked along dim 0, without autograd: a view of their shared storage when they
    are adjacent (``_adjacent``), else a copy."""
    with torch.no_grad():
        if _adjacent(weights):
            first = weights[0]
            rows = sum(w.shape[0] for w in weights)
            return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
        return torch.cat([w.detach() for w in weights])


class _PackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        w = packed_weight(weights)
        ctx.save_for_backward(x, w)
        ctx.rows = [t.shape[0] for t in weights]
        sink = getattr(x, "wgrad_sink", None)
        ctx.sink_indices = sink.indices(weights) if sink is not None else None
        ctx.sink = sink if ctx.sink_indices is not None else None
        return F.linear(x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = grad.matmul(w) if ctx.needs_input_grad[0] else None
        if ctx.sink is not None:
            ctx.sink.add(ctx.sink_indices, grad)
            return (dx, *[None] * len(ctx.rows))
        dw = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return (dx, *dw.split(ctx.rows))


def packed_linear(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w) for w in weights], -1)`` as one GEMM each way (module docstring)."""
    return _PackedLinear.apply(x, *weights)
