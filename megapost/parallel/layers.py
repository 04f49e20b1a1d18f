"""Tensor-parallel linear and embedding layers, each built from a full-size initialised module.

A layer keeps only this rank's contiguous shard of the full weight, so initialisation does not depend
on the layout. Sharded parameters carry the attributes DeepSpeed and Megatron tooling read:
``tensor_model_parallel`` (DeepSpeed's ``is_model_parallel_parameter``, used to count a shard in the
gradient norm on every tensor-parallel rank), ``partition_dim`` and ``partition_stride``. Parameter
names (``weight``, ``bias``) are those of the module replaced, so state dicts keep their keys.

A weight split into fewer slices than TP ranks (grouped-query K/V with fewer groups than ranks) is
*replicated*: ``partition_replicas`` = r consecutive ranks hold each slice, rank t slice t // r, and
only the first of them is tagged ``tensor_model_parallel`` so the slice counts once in the norm.
Every sharded parameter has ``partition_dim``; gathering all TP ranks' tensors and keeping every r-th
chunk rebuilds the full weight (``megapost.parallel.gather``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapost.parallel import collectives as C
from megapost.parallel.async_linear import WeightGradSink, deferred_linear, enter_deferred
from megapost.parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
    share_replicated_slice,
)
from megapost.parallel.shard_spec import declare

INPUT_MAPPINGS = {
    "copy": copy_to_tp_region,  # replicated input; all-reduce its gradient
    "gather_seq": gather_from_sequence_region,  # sequence-parallel input; all-gather it
    None: lambda x, group: x,  # the caller already mapped the input (shared by several layers)
}


def tp_rank_size(group: Any) -> tuple[int, int]:
    """(rank, size) in ``group``; (0, 1) without one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def shard(full: torch.Tensor, dim: int, group: Any, replicas: int = 1) -> nn.Parameter:
    """This rank's contiguous shard of ``full`` along ``dim`` as a new, tagged parameter: one of
    size / ``replicas`` equal slices, slice rank // ``replicas``."""
    rank, size = tp_rank_size(group)
    if size % replicas or full.shape[dim] % (size // replicas):
        raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} over {size} TP ranks "
                         f"with {replicas} replicas per slice")
    part = full.detach().chunk(size // replicas, dim=dim)[rank // replicas].clone()
    param = nn.Parameter(part, requires_grad=full.requires_grad)
    param.tensor_model_parallel = rank % replicas == 0
    param.partition_dim = dim
    param.partition_stride = 1
    if replicas > 1:
        param.partition_replicas = replicas
    declare(param, dim, replicas)  # what a checkpoint records (megapost.parallel.shard_spec)
    return param


def mark_sequence_parallel(param: nn.Parameter, group: Any) -> None:
    """A replicated parameter applied to sequence shards (or to this rank's heads): its gradient is a
    partial sum over the tensor-parallel group, so a gradient hook all-reduces it before it is
    accumulated (no trainer call needed; correct under gradient accumulation and recomputation)."""
    if getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True
    if group is not None and C.group_size(group) > 1:
        param.sequence_parallel_hook = param.register_hook(lambda grad: C.all_reduce(grad, group))


def defer_sequence_parallel_reduction(module: nn.Module) -> list[nn.Parameter]:
    """Remove the per-micro-batch all-reduce hooks of ``mark_sequence_parallel`` from ``module``'s
    parameters and return those parameters: their gradients stay partial sums over the tensor-parallel
    group until the caller sums them once per step (megapost.parallel.dist_optimizer's
    ``partial_sums``), in one bucketed all-reduce instead of one per parameter per micro-batch."""
    out = []
    for p in module.parameters():
        handle = p.__dict__.pop("sequence_parallel_hook", None)
        if handle is not None:
            handle.remove()
            out.append(p)
    return out


def map_column_input(x: torch.Tensor, group: Any, gather_seq: bool, projections: list[Any],
                     overlap: bool) -> torch.Tensor:
    """``x`` entering the column-parallel region shared by ``projections`` (ColumnParallelLinear):
    all-reduce its gradient, or under sequence parallelism all-gather it (reduce-scatter the
    gradient). With ``overlap`` (and autograd on, not compiling, TP > 1, every projection able) the
    mapping's backward also computes the projections' weight gradients while its collective is in flight
    (megapost.parallel.async_linear); else the plain mapping."""
    defer = (overlap and torch.is_grad_enabled() and not torch.compiler.is_compiling() and group is not None
             and C.group_size(group) > 1 and all(p.can_defer() for p in projections))
    for p in projections:
        if p.deferred is not None:  # a previous forward's (never set while compiling)
            p.deferred = None
    if not defer:
        return (gather_from_sequence_region if gather_seq else copy_to_tp_region)(x, group)
    out = enter_deferred(x, group, gather_seq, projections)
    for p, w in zip(projections, out.wgrad_sink.weights, strict=True):
        p.deferred = (out.wgrad_sink, w)
    return out


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split by output rows: this rank computes y[..., shard].

    ``input_mapping``: "copy" (input replicated over TP), "gather_seq" (input sequence-sharded), or
    None when the caller already applied one mapping shared by several layers. ``gather_output``
    all-gathers the output shards; otherwise the output stays sharded on the last dimension.
    ``replicas`` > 1: A is cut into tp / replicas row blocks, each held by ``replicas`` consecutive
    ranks whose weight gradients are summed (``share_replicated_slice``); no output gather then.
    """

    def __init__(self, full: nn.Linear, group: Any, input_mapping: str | None = "copy",
                 gather_output: bool = False, replicas: int = 1, overlap: bool = False) -> None:
        super().__init__()
        if replicas > 1 and gather_output:
            raise ValueError("a replicated ColumnParallelLinear cannot gather its output")
        self.group = group
        self.in_features, self.out_features = full.in_features, full.out_features
        self.input_mapping = input_mapping
        self.map_input = INPUT_MAPPINGS[input_mapping]
        self.gather_output = gather_output
        self.replicas = replicas
        self.overlap = overlap  # own input mapping: megapost.parallel.async_linear's backward overlap
        self.weight = shard(full.weight, 0, group, replicas)
        self.bias = shard(full.bias, 0, group, replicas) if full.bias is not None else None
        self.deferred: tuple[WeightGradSink, torch.Tensor] | None = None  # set by the input's mapping

    def effective_weight(self) -> torch.Tensor:
        """The weight the GEMM multiplies with: this rank's shard, summed over the ranks sharing it
        in backward when ``replicas`` > 1."""
        if self.replicas > 1:
            return share_replicated_slice(self.weight, self.group, self.replicas)
        return self.weight

    def can_defer(self) -> bool:
        """Whether the weight gradient may be computed by the input mapping's backward
        (megapost.parallel.async_linear): no bias, no output gather."""
        return self.bias is None and not self.gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.map_input is not INPUT_MAPPINGS[None]:
            x = map_column_input(x, self.group, self.input_mapping == "gather_seq", [self], self.overlap)
        if self.deferred is not None and getattr(x, "wgrad_sink", None) is self.deferred[0]:
            return deferred_linear(x, self.deferred[1], self.deferred[0])
        weight, bias = self.weight, self.bias
        if self.replicas > 1:
            weight = share_replicated_slice(weight, self.group, self.replicas)
            bias = None if bias is None else share_replicated_slice(bias, self.group, self.replicas)
        y = F.linear(x, weight, bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def packable_weight(self) -> torch.Tensor | None:
        """This rank's weight for a parent that multiplies the input (already mapped by it) with several
        sibling projections in one GEMM (``megapost.model.fusion``): its own heads' rows, so a packed
        Q/K/V holds this rank's q, k and v; the one its input's mapping holds when that mapping computes
        the weight gradients. None when this layer maps its own input, gathers its output or has a
        bias."""
        if self.map_input is not INPUT_MAPPINGS[None] or self.gather_output or self.bias is not None:
            return None
        return self.deferred[1] if self.deferred is not None else self.effective_weight()

    def extra_repr(self) -> str:
        shared = f", shared by {self.replicas} ranks" if self.replicas > 1 else ""
        return f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}{shared})"


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by input columns: partial products are summed over TP (all-reduce), or
    under sequence parallelism reduce-scattered into sequence shards. The bias is added once, after
    the reduction."""

    def __init__(self, full: nn.Linear, group: Any, sequence_parallel: bool = False,
                 input_is_parallel: bool = True) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = full.in_features, full.out_features
        self.sequence_parallel = sequence_parallel
        self.input_is_parallel = input_is_parallel
        self.weight = shard(full.weight, 1, group)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())
            if sequence_parallel:
                mark_sequence_parallel(self.bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = F.linear(x, self.weight)
        reduce = reduce_scatter_to_sequence_region if self.sequence_parallel else reduce_from_tp_region
        y = reduce(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over TP. Ids outside this rank's rows look up
    zeros; the partial embeddings are all-reduced, or reduce-scattered into sequence shards."""

    def __init__(self, full: nn.Embedding, group: Any, sequence_parallel: bool = False) -> None:
        super().__init__()
        if full.padding_idx is not None or full.max_norm is not None:
            raise ValueError("VocabParallelEmbedding supports plain embeddings (no padding_idx/max_norm)")
        self.group = group
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        self.sequence_parallel = sequence_parallel
        self.weight = shard(full.weight, 0, group)
        rank, _ = tp_rank_size(group)
        self.vocab_start = rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        reduce = reduce_scatter_to_sequence_region if self.sequence_parallel else reduce_from_tp_region
        return reduce(x, self.group)

    def extra_repr(self) -> str:
        rows = f"rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0] - 1}"
        return f"{self.num_embeddings}, {self.embedding_dim} ({rows} here)"
