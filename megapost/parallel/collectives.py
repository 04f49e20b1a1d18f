"""Raw collectives along one tensor dimension over a process group, with byte accounting.

These are the only calls into ``torch.distributed`` that the tensor-parallel mappings make. All-gather
and reduce-scatter use the single-tensor collectives (``all_gather_single``/``reduce_scatter_single``
on torch >= 2.13, ``*_into_tensor``/``*_tensor`` before). A backend that lacks them (gloo before torch
2.6 has no reduce-scatter) gets a fallback after its first refusal: reduce-scatter becomes an
all-reduce followed by keeping this rank's slice (twice the bytes of a ring reduce-scatter, same
result), and all-gather becomes the list form of ``all_gather``. ``FORCE_FALLBACK`` selects the
fallbacks everywhere, so tests can cover them on a backend that does not need them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FORCE_FALLBACK = False

_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_unsupported: set[tuple[str, str]] = set()  # (operation, backend) pairs that raised once


@dataclass
class CommStats:
    """Bytes and calls per operation. ``bytes`` is the full (unsharded) tensor each call moves: the
    all-reduced tensor, the gathered output, the reduce-scattered input (the figure Megatron's
    communication analysis uses); multiply by the ring factor for wire bytes."""

    enabled: bool = False
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, tensor: torch.Tensor) -> None:
        if self.enabled:
            self.bytes[op] += tensor.numel() * tensor.element_size()
            self.calls[op] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


_counter: CommStats | None = None  # the open ``counting_comm`` block's counter; None outside one


@contextmanager
def counting_comm(stats: CommStats | None = None) -> Iterator[CommStats]:
    """Count the tensor-parallel collectives issued inside the block into ``stats`` (the caller's, or a
    fresh one; enabled on entry, its ``enabled`` may be switched inside, e.g. per step). The counter is
    process-wide while the block runs (the collectives run inside the model's layers and autograd's
    backward threads, where nothing is passed down) and removed when it ends."""
    global _counter
    stats = stats if stats is not None else CommStats()
    stats.enabled, previous, _counter = True, _counter, stats
    try:
        yield stats
    finally:
        _counter = previous


def active_counter() -> CommStats | None:
    """The counter of the open ``counting_comm`` block, if any."""
    return _counter


def _record(op: str, tensor: torch.Tensor) -> None:
    if _counter is not None:
        _counter.record(op, tensor)


def group_size(group: Any) -> int:
    return dist.get_world_size(group=group)


def _native(op: str, group: Any) -> bool:
    return not FORCE_FALLBACK and (op, dist.get_backend(group)) not in _unsupported


def _fallback_or_raise(op: str, group: Any) -> None:
    """Only gloo lacks the tensor collectives: remember to use the list form there. On any other
    backend (NCCL) the error is real and is raised, never retried through the fallback."""
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise
    _unsupported.add((op, backend))


def all_reduce(x: torch.Tensor, group: Any, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over ``group``; returns a new tensor, ``x`` is untouched."""
    return start_all_reduce(x, group, op).wait()


def split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {n} equal parts")
    return x.chunk(n, dim=dim)[dist.get_rank(group=group)].contiguous()


def all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    n = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    _record("all_gather", out)
    if _native("all_gather", group):
        try:
            _all_gather_tensor(out, front, group=group)
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError):
            _fallback_or_raise("all_gather", group)
    dist.all_gather(list(out.chunk(n)), front, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``."""
    return start_reduce_scatter(x, dim, group).wait()


class Pending:
    """A collective in flight (``async_op``): ``wait()`` returns its result. On CUDA, NCCL runs it on
    its own stream and ``wait`` makes the current stream wait for it; on gloo a background thread."""

    def __init__(self, work: Any, finish: Any) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.finish()


def start_all_reduce(x: torch.Tensor, group: Any, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
    """``all_reduce`` issued asynchronously (a clone of ``x`` reduced in place; ``x`` is untouched)."""
    out = x.contiguous().clone()
    _record("all_reduce", out)
    return Pending(dist.all_reduce(out, op=op, group=group, async_op=True), lambda: out)


def start_reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> Pending:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``, issued asynchronously (the
    fallback where the backend lacks a reduce-scatter: an all-reduce, then this rank's slice)."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {n} equal parts")
    front = x.movedim(dim, 0).contiguous()
    _record("reduce_scatter", front)
    if _native("reduce_scatter", group):
        out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            work = _reduce_scatter_tensor(out, front, group=group, async_op=True)
            return Pending(work, lambda: out.movedim(0, dim).contiguous())
        except (RuntimeError, NotImplementedError):
            _fallback_or_raise("reduce_scatter", group)
    summed = front.clone()
    work = dist.all_reduce(summed, group=group, async_op=True)
    return Pending(work, lambda: summed.chunk(n)[dist.get_rank(group=group)].movedim(0, dim).contiguous())
