"""Megatron's distributed optimizer over one data-parallel group, without DeepSpeed: the parameters live
in flat buckets (forward order), each bucket split into ``dp`` equal shards; each rank keeps fp32 master
weights, optimizer state and the reduced gradient of its shard only.

Per optimizer step:

- every micro-batch's backward adds each gradient into the bucket's fp32 accumulator and frees it;
  during the last micro-batch's backward a bucket is **reduce-scattered** (async, in ``reduce_dtype``:
  fp32, or bf16 as Megatron's ``--grad-reduce-in-bf16``) as soon as its last gradient is in, so the
  reduction overlaps the rest of that backward (``finish_grad_sync`` waits before the step);
- the optimizer steps the fp32 shard (global norm over ``norm_groups``, clipping, a non-finite norm
  skips the step on every rank);
- the updated shard, cast to the model dtype, is **all-gathered** bucket by bucket during the next
  forward: bucket 0's gather is dispatched by the step, and a forward pre-hook of a module whose
  parameters sit in bucket ``i`` waits for that gather and dispatches bucket ``i + 1``'s.

Per rank per step on a ring of ``n`` ranks with P parameters: (n-1)/n * P * (4 or 2) bytes reduce-scattered
and (n-1)/n * P * (2 bf16, 4 fp32) gathered (megapost.parallel.reduce_bytes.dist_optimizer_bytes).
``partial_sums`` (group, parameters): gradients that are partial sums over ``group`` (sequence-parallel
norm gains, megapost.parallel.layers.defer_sequence_parallel_reduction) are summed there once per step,
all of this rank's slices in one all-reduce after the reduce-scatter (the two sums commute).
``trace`` (a callable) records the issue order of collectives for tests/test_dist_optimizer.py.
``group_of`` (parameter -> optimizer param-group index, e.g. Megatron's no weight decay on 1-D gains):
each shard is then cut into runs of one group, each run a parameter of that group, views of the shard.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_NUMEL = 40_000_000  # Megatron's default --ddp-bucket-size scale (elements)


@dataclass(frozen=True)
class BucketLayout:
    """Parameters ``first..last`` (indices into the forward-ordered list) at ``offsets`` in a flat
    bucket of ``numel`` elements (padded to a multiple of the group size)."""

    first: int
    last: int
    offsets: tuple[int, ...]
    numel: int

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        n = self.numel // size
        return rank * n, (rank + 1) * n


def bucket_layouts(sizes: Sequence[int], bucket_numel: int, dp: int) -> list[BucketLayout]:
    """Consecutive parameters of ``sizes`` packed into buckets closed once they hold ``bucket_numel``
    elements (a parameter is never split), each padded to a multiple of ``dp``."""
    out: list[BucketLayout] = []
    first, offsets, used = 0, [], 0
    for i, n in enumerate(sizes):
        offsets.append(used)
        used += n
        if used >= bucket_numel or i == len(sizes) - 1:
            out.append(BucketLayout(first, i, tuple(offsets), math.ceil(used / dp) * dp))
            first, offsets, used = i + 1, [], 0
    return out


@dataclass
class _Bucket:
    layout: BucketLayout
    params: list[nn.Parameter]
    param_buf: torch.Tensor  # model dtype; the parameters are views of it
    grad_buf: torch.Tensor  # fp32 accumulator of every micro-batch's gradients
    master: torch.Tensor  # fp32 shard of the weights, stepped by the optimizer through ``segments``
    grad_shard: torch.Tensor  # reduce-scatter output (reduce dtype)
    lo: int = 0
    hi: int = 0
    ready: int = 0  # gradients of the last micro-batch accumulated so far
    reduce: Any = None  # async reduce-scatter handle
    gather: Any = None  # async all-gather handle
    gather_due: bool = False  # updated weights not yet gathered
    hooks: list[Any] = field(default_factory=list)
    segments: list[tuple[int, nn.Parameter]] = field(default_factory=list)  # (group, view of master)
    grad: torch.Tensor | None = None  # the averaged fp32 gradient of the shard, between sync and step


def _collective(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>``, looked up at call time (benchmarks wrap it to count bytes)."""
    fn = getattr(dist, name)

    def call(*args: Any, **kw: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renamed them *_single
            return fn(*args, **kw)

    return call


class DistributedOptimizer:
    """The distributed optimizer of the module docstring for ``params`` (forward order) of ``modules``
    on ``group``; ``make_optimizer`` builds the torch optimizer over the fp32 shard parameters (a list; with
    ``group_of``, one list per param group)."""

    def __init__(self, params: Sequence[nn.Parameter], make_optimizer: Callable[[list[Any]], Any],
                 group: Any = None, *, reduce_dtype: torch.dtype = torch.float32,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, clip_grad: float = 0.0,
                 norm_groups: Iterable[Any] = (), norm_weight: Callable[[nn.Parameter], float] | None = None,
                 partial_sums: tuple[Any, Sequence[nn.Parameter]] | None = None,
                 trace: Callable[[str], None] | None = None,
                 group_of: Callable[[nn.Parameter], int] | None = None) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.reduce_dtype, self.clip_grad = reduce_dtype, clip_grad
        self.norm_groups = list(norm_groups)
        self.trace = trace or (lambda _event: None)
        self.last_micro_batch = True
        self.buckets = [self._make_bucket(lay, list(params[lay.first:lay.last + 1]))
                        for lay in bucket_layouts([p.numel() for p in params], bucket_numel, self.size)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._offset_of = {id(p): off for b in self.buckets for p, off in zip(b.params, b.layout.offsets,
                                                                             strict=True)}
        weight = norm_weight or (lambda _p: 1.0)
        self._norm_weight = [self._flat(b, [torch.full((p.numel(),), weight(p)) for p in b.params])[b.lo:b.hi]
                             for b in self.buckets]
        for b in self.buckets:
            b.segments = _segments(b, group_of)
        segs = [seg for b in self.buckets for seg in b.segments]
        groups = 1 + max(g for g, _ in segs)
        self.optimizer = make_optimizer([p for _g, p in segs] if group_of is None else
                                        [[p for g, p in segs if g == i] for i in range(groups)])
        self._partial_group, self._partial = None, []
        if partial_sums is not None:
            self._partial_group, wanted = partial_sums[0], {id(p) for p in partial_sums[1]}
            for b in self.buckets:
                for p, off in zip(b.params, b.layout.offsets, strict=True):
                    lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
                    if id(p) in wanted and lo < hi:
                        self._partial.append((b, lo - b.lo, hi - b.lo))
        for b in self.buckets:
            for p in b.params:
                b.hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self.grad_norm = torch.zeros(())
        self.skipped = torch.zeros((), dtype=torch.bool)

    def _make_bucket(self, lay: BucketLayout, params: list[nn.Parameter]) -> _Bucket:
        dtype = params[0].dtype
        param_buf = torch.zeros(lay.numel, dtype=dtype, device=params[0].device)
        for p, off in zip(params, lay.offsets, strict=True):
            param_buf[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = param_buf[off:off + p.numel()].view_as(p)
        lo, hi = lay.shard(self.rank, self.size)
        grad_buf = torch.zeros(lay.numel, dtype=torch.float32, device=param_buf.device)
        master = param_buf[lo:hi].detach().float().clone()
        grad_shard = torch.zeros(hi - lo, dtype=self.reduce_dtype, device=param_buf.device)
        return _Bucket(lay, params, param_buf, grad_buf, master, grad_shard, lo, hi)

    @staticmethod
    def _flat(b: _Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One fp32 tensor per parameter of ``b`` laid out as the bucket (zero padding)."""
        flat = torch.zeros(b.layout.numel, dtype=torch.float32, device=b.param_buf.device)
        for p, off, t in zip(b.params, b.layout.offsets, tensors, strict=True):
            flat[off:off + p.numel()] = t.reshape(-1)
        return flat

    # ------------------------------------------------------------------ gradients

    def start_micro_batch(self, last: bool) -> None:
        """Call before each micro-batch's backward; ``last``: the one whose gradients are reduced."""
        self.last_micro_batch = last

    def _grad_hook(self, p: nn.Parameter) -> None:
        b = self._bucket_of[id(p)]
        off = self._offset_of[id(p)]
        b.grad_buf[off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        if self.last_micro_batch:
            b.ready += 1
            if b.ready == len(b.params):
                self._start_reduce(b)

    def _start_reduce(self, b: _Bucket) -> None:
        self.trace(f"reduce_scatter {self.buckets.index(b)}")
        src = b.grad_buf if self.reduce_dtype == torch.float32 else b.grad_buf.to(self.reduce_dtype)
        b.reduce = _collective("reduce_scatter_tensor")(b.grad_shard, src, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Reduce any bucket not yet reduced (a parameter without a gradient), wait for all, and hand the
        averaged fp32 shard gradients to the optimizer's parameters."""
        for b in self.buckets:
            if b.reduce is None:
                self._start_reduce(b)
        for b in self.buckets:
            b.reduce.wait()
            b.reduce, b.ready = None, 0
        if self._partial:  # the same slices on every rank of the group: identical bucket layouts
            self.trace("partial_sums")
            flat = torch.cat([b.grad_shard[s:e].float() for b, s, e in self._partial])
            dist.all_reduce(flat, group=self._partial_group)
            i = 0
            for b, s, e in self._partial:
                b.grad_shard[s:e].copy_(flat[i:i + e - s])
                i += e - s
        for b in self.buckets:
            b.grad = b.grad_shard.float().div_(self.size)
            for _g, seg in b.segments:
                seg.grad = b.grad[seg_slice(b, seg)]

    # ------------------------------------------------------------------ the step

    def _global_norm(self) -> torch.Tensor:
        sq = sum(((b.grad.double() ** 2) * w).sum() for b, w in zip(self.buckets, self._norm_weight,
                                                                          strict=True))
        sq = torch.as_tensor(sq, dtype=torch.float64)
        for g in [self.group, *self.norm_groups]:
            dist.all_reduce(sq, group=g)
        return sq.sqrt().float()

    def step(self) -> bool:
        """Reduce, clip and step the shard; dispatch bucket 0's gather. Returns False (every rank alike)
        when the global gradient norm is not finite: the step is skipped, the gradients dropped."""
        self.finish_grad_sync()
        return not bool(self.apply())

    def apply(self) -> torch.Tensor:
        """After ``finish_grad_sync``: the global norm, clipping and the optimizer step on the shard, bucket
        0's gather dispatched; returns the 0-d device flag ``skipped`` (the norm is not finite). With an
        optimizer that takes ``found_inf`` (fused Adam/AdamW) the skip stays on the device (weights,
        moments and step counts unchanged, no host read); otherwise it is read on the host."""
        self.grad_norm = self._global_norm()
        self.skipped = ~torch.isfinite(self.grad_norm)
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (self.grad_norm + 1e-6), max=1.0)
            for b in self.buckets:
                b.grad.mul_(coef)
        if takes_found_inf(self.optimizer):
            self.optimizer.found_inf = self.skipped.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            stepped = True
        else:
            stepped = not bool(self.skipped)
            if stepped:
                self.optimizer.step()
        if stepped:  # skipped on the device: the masters are unchanged, so are the copies
            for b in self.buckets:
                b.param_buf[b.lo:b.hi].copy_(b.master.detach())
                b.gather_due = True
        for b in self.buckets:
            b.grad = None
            for _g, seg in b.segments:
                seg.grad = None
            b.grad_buf.zero_()
        if self.buckets[0].gather_due:
            self._dispatch_gather(0)
        return self.skipped

    def offset(self, p: nn.Parameter) -> int:
        """Where ``p`` starts in its bucket."""
        return self._offset_of[id(p)]

    def owned(self, p: nn.Parameter) -> tuple[_Bucket, int, int] | None:
        """(bucket, start, end) of the part of ``p`` (flattened) in this rank's shard; None if none."""
        b = self._bucket_of.get(id(p))
        if b is None:
            return None
        off = self._offset_of[id(p)]
        lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
        return (b, lo - off, hi - off) if lo < hi else None

    # ------------------------------------------------------------------ weights

    def _dispatch_gather(self, i: int) -> None:
        b = self.buckets[i]
        if b.gather is None and b.gather_due:
            self.trace(f"all_gather {i}")
            shard = b.param_buf[b.lo:b.hi].clone()
            b.gather = _collective("all_gather_into_tensor")(b.param_buf, shard, group=self.group,
                                                             async_op=True)

    def _finish_gather(self, i: int) -> None:
        b = self.buckets[i]
        self._dispatch_gather(i)
        if b.gather is not None:
            b.gather.wait()
            b.gather, b.gather_due = None, False
            self.trace(f"gathered {i}")
        if i + 1 < len(self.buckets):
            self._dispatch_gather(i + 1)

    def rebuild_weights(self) -> None:
        """The model's weights from the fp32 masters (after they were written): every bucket's slice cast
        and all-gathered now (collective)."""
        self.finish_param_sync()
        with torch.no_grad():
            for b in self.buckets:
                b.param_buf[b.lo:b.hi].copy_(b.master)
                b.gather_due = True
        self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every bucket's gather (before a save, an evaluation outside the hooks, or the end)."""
        for i in range(len(self.buckets)):
            self._finish_gather(i)

    def install_forward_hooks(self, modules: Iterable[nn.Module]) -> list[Any]:
        """A pre-hook on each module with parameters of its own: wait for their buckets' gathers (in
        order) and dispatch the next bucket's; returns the handles."""
        handles = []
        for m in modules:
            own = [self.buckets.index(self._bucket_of[id(p)]) for p in m.parameters(recurse=False)
                   if id(p) in self._bucket_of]
            if own:
                def hook(_m: nn.Module, _args: Any, last: int = max(own)) -> None:
                    for i in range(last + 1):
                        if self.buckets[i].gather_due:
                            self._finish_gather(i)
                handles.append(m.register_forward_pre_hook(hook))
        return handles

    # ------------------------------------------------------------------ checkpoints

    def _gather_full(self, shard_of: Callable[[_Bucket], torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for b in self.buckets:
            full = torch.empty(b.layout.numel, dtype=torch.float32, device=b.param_buf.device)
            shard = shard_of(b).detach().float().contiguous()
            _collective("all_gather_into_tensor")(full, shard, group=self.group)
            out += [full[off:off + p.numel()].view_as(p).clone() for p, off in zip(b.params, b.layout.offsets,
                                                                                strict=True)]
        return out

    def full_state(self) -> dict[str, Any]:
        """Layout-free fp32 master weights and optimizer state, one tensor per parameter (forward order),
        the same on every rank, plus the optimizer's scalars ("scalars": its step count): what a
        checkpoint stores, loadable at any data-parallel size and bucket size."""
        seg0 = self.buckets[0].segments[0][1]
        first = self.optimizer.state.get(seg0, {})
        state: dict[str, Any] = {"master": self._gather_full(lambda b: b.master)}
        state["scalars"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.items()
                            if not (torch.is_tensor(v) and v.shape == seg0.shape)}
        for k in (k for k in first if k not in state["scalars"]):
            state[k] = self._gather_full(lambda b, k=k: torch.cat([self.optimizer.state[p][k]
                                                                   for _g, p in b.segments]))
        return state

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Take this rank's shard of ``full_state``'s tensors (saved at any data-parallel size)."""
        def shard(b: _Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
            return self._flat(b, tensors[b.layout.first:b.layout.last + 1])[b.lo:b.hi].clone()

        with torch.no_grad():
            for b in self.buckets:
                b.master.copy_(shard(b, state["master"]))
                for p, t in zip(b.params, state["master"][b.layout.first:b.layout.last + 1], strict=True):
                    p.copy_(t.view_as(p))
                tensors = {k: shard(b, v) for k, v in state.items() if k not in ("master", "scalars")}
                for _g, seg in b.segments:
                    slot = self.optimizer.state[seg]
                    slot.update({k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in state["scalars"].items()})
                    slot.update({k: v[seg_slice(b, seg)].clone() for k, v in tensors.items()})


def takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` skips on a nonzero ``found_inf`` (torch's fused Adam and AdamW)."""
    adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    return adam and bool(optimizer.defaults.get("fused"))


def seg_slice(b: _Bucket, seg: torch.Tensor) -> slice:
    """Where the view ``seg`` lies in ``b.master``."""
    start = seg.storage_offset() - b.master.storage_offset()
    return slice(start, start + seg.numel())


def _segments(b: _Bucket, group_of: Callable[[nn.Parameter], int] | None) -> list[tuple[int, nn.Parameter]]:
    """The shard as one parameter (no ``group_of``), or as runs of one param group each (the padding
    after the last parameter joins the run before it), each a view of ``b.master``."""
    if group_of is None:
        return [(0, nn.Parameter(b.master))]
    runs: list[list[int]] = []  # [group, start, end] in shard coordinates
    for p, off in zip(b.params, b.layout.offsets, strict=True):
        lo, hi = max(off, b.lo) - b.lo, min(off + p.numel(), b.hi) - b.lo
        if lo >= hi:
            continue
        g = group_of(p)
        if runs and runs[-1][0] == g:
            runs[-1][2] = hi
        else:
            runs.append([g, lo, hi])
    if not runs:  # a shard of padding only
        return [(0, nn.Parameter(b.master))]
    runs[-1][2] = b.hi - b.lo  # parameters are packed without gaps: the runs tile the shard
    return [(g, nn.Parameter(b.master[lo:hi])) for g, lo, hi in runs]
