"""Autograd-aware collectives that move activations in and out of tensor-parallel regions.

Each mapping is an ``autograd.Function`` whose backward is the adjoint of its forward:

    mapping                            forward                    backward
    copy_to_tp_region                  identity                   all-reduce
    reduce_from_tp_region              all-reduce                 identity
    scatter_to_tp_region               split last dim             all-gather last dim
    gather_from_tp_region              all-gather last dim        split last dim
    scatter_to_sequence_region         split seq dim              all-gather seq dim
    gather_from_sequence_region        all-gather seq dim         reduce-scatter seq dim
    reduce_scatter_to_sequence_region  reduce-scatter seq dim     all-gather seq dim
    share_replicated_slice             identity                   sum over the ranks sharing the slice

Activations are [batch, seq, hidden], so the sequence dimension is 1 (Megatron's is 0). On a group of
one rank, or with no group, every mapping is the identity and issues no collective. ``torch.compile``
does not trace into them (a graph break at each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megapost.parallel import collectives as C

SEQ_DIM = 1

Op = Callable[[torch.Tensor, Any], torch.Tensor]


def _identity(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.all_reduce(x, group)


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.split(x, -1, group)


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.all_gather(x, x.dim() - 1, group)


def _split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.split(x, SEQ_DIM, group)


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.all_gather(x, SEQ_DIM, group)


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return C.reduce_scatter(x, SEQ_DIM, group)


def _mapping(name: str, forward: Op, backward: Op) -> type[torch.autograd.Function]:
    """An autograd Function applying ``forward`` to the input and ``backward`` to its gradient."""

    def fwd(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    methods = {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    return type(name, (torch.autograd.Function,), methods)


_CopyToTP = _mapping("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _mapping("_ReduceFromTP", _all_reduce, _identity)
_ScatterToTP = _mapping("_ScatterToTP", _split_last, _gather_last)
_GatherFromTP = _mapping("_GatherFromTP", _gather_last, _split_last)
_ScatterToSeq = _mapping("_ScatterToSeq", _split_seq, _gather_seq)
_GatherFromSeq = _mapping("_GatherFromSeq", _gather_seq, _reduce_scatter_seq)
_ReduceScatterToSeq = _mapping("_ReduceScatterToSeq", _reduce_scatter_seq, _gather_seq)


@torch.compiler.disable  # under --compile, each collective is a clean graph break
def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None or C.group_size(group) == 1:
        return x
    return fn.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a column-parallel region with a replicated input (its gradient is summed over TP)."""
    return _apply(_CopyToTP, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a row-parallel region by summing the partial outputs."""
    return _apply(_ReduceFromTP, x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's slice of the last dimension."""
    return _apply(_ScatterToTP, x, group)


def gather_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the last-dimension shards (e.g. vocab-sharded logits into full logits)."""
    return _apply(_GatherFromTP, x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's sequence shard [b, s/tp, h] of a replicated [b, s, h]."""
    return _apply(_ScatterToSeq, x, group)


def gather_from_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather sequence shards into [b, s, h] for a tensor-parallel consumer (whose input gradients
    are partial sums, hence the reduce-scatter backward)."""
    return _apply(_GatherFromSeq, x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum row-parallel partial outputs [b, s, h] and keep this rank's sequence shard."""
    return _apply(_ReduceScatterToSeq, x, group)


class _ShareReplicatedSlice(torch.autograd.Function):
    """A weight slice held by ``replicas`` consecutive TP ranks (rank r holds slice r // replicas):
    forward is the identity, backward sums the gradient over the ranks holding the same slice. The
    gradient goes into slot r // replicas of a zero buffer with one slot per slice and that buffer is
    all-reduced over TP: exact (the other slots add zeros) and needs no sub-groups."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any, replicas: int) -> torch.Tensor:
        ctx.group, ctx.replicas = group, replicas
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        slot = dist.get_rank(group=ctx.group) // ctx.replicas
        slots = torch.zeros((C.group_size(ctx.group) // ctx.replicas, *grad.shape), dtype=grad.dtype,
                            device=grad.device)
        slots[slot] = grad
        return C.all_reduce(slots, ctx.group)[slot], None, None


@torch.compiler.disable
def share_replicated_slice(w: torch.Tensor, group: Any, replicas: int) -> torch.Tensor:
    """``w`` (this rank's copy of a slice replicated on ``replicas`` TP ranks), whose gradient is summed
    over those ranks; the identity when nothing is replicated."""
    if replicas == 1 or group is None or C.group_size(group) == 1:
        return w
    return _ShareReplicatedSlice.apply(w, group, replicas)
