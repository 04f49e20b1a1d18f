"""The probe listener: forward statistics and activation-gradient hooks of one measured step.

Attached (``set_listener``) only for a measured step; it adds into a ``StatsBuffer`` on the
activations' device and never synchronises. Per sublayer call it records t_sim of X_k, Y_k and the
normalised output, ||y_i||, the RMS factor sqrt(d)/||u_i|| of the norm input u (none where the probe
passes ``norm_in=None``: no residual-stream RMSNorm; docs/placements.md), and registers tensor
hooks adding ||dL/dX_k||_F^2 and ||dL/dY_k||_F^2 (squared norms pool over micro-batches and ranks,
so alpha = sqrt(sum gx / sum gy) does not depend on how the batch is split).

Which forward calls count (activation checkpointing, forward-only steps). Per probe:
  * grad mode off (a no-grad first pass of reentrant checkpointing, or the step-0 forward-only pass):
    record the statistics and remember one "pending" forward;
  * grad mode on, outside backward (ordinary forward, or the first pass of non-reentrant
    checkpointing): record the statistics and register the gradient hooks;
  * grad mode on, inside backward (a recompute): if a pending no-grad forward exists, this is its
    reentrant recompute, so register the hooks only (statistics were taken in the first pass);
    otherwise it repeats a forward already recorded (non-reentrant recompute) and is ignored.
So each micro-batch is counted once, from its first forward, and gradients come from the forward
whose graph the backward actually traverses. A recompute that is hidden from the listener (as
``megapost.parallel.activation_checkpoint`` does for the non-reentrant checkpoint) needs nothing.

Under sequence parallelism x, y, out are sequence shards [b, s/tp, d]: token sums and gradient
squared norms are additive over the tensor-parallel ranks as they are, while t_sim needs the
per-sequence partials [row sum, sum of squares, count] summed over TP first; those are kept in
``sequence_partials`` and finished by ``finish_sequence_parallel`` after one all-reduce.

Cost: per new tensor a probe shows, two reductions (token norms [b, s] and the per-sequence row sum
[b, d]); per gradient hook one norm. Everything nonlinear (t_sim, residual norms, RMS factors, their
extrema, squared gradient norms) is finished in one batched pass per step (``end_step``: stacked
tensors, ``index_add_`` / ``index_reduce_`` into the buffer at host-known offsets), so the Python and
kernel count per probe stay small and nothing is read back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from .similarity import EPS, accumulation_dtype, norm, token_norms
from .table import COL, SITES, SUBLAYERS, StatsBuffer

FLUSH_TENSORS = 4096  # summaries kept before a batched pass (bounds the memory they hold)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass in this thread."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() >= 0


class Recorder:
    """Callable probe listener writing into ``buf`` (rows: ``buf.row``)."""

    def __init__(self, buf: StatsBuffer, sequence_parallel: bool = False) -> None:
        self.buf = buf
        self.sequence_parallel = sequence_parallel
        self.pending: dict[tuple[Any, ...], int] = defaultdict(int)
        # per summarised tensor: token norms [b, s], row sums [b, d], d
        self.norms: list[torch.Tensor] = []
        self.row_sums: list[torch.Tensor] = []
        self.dims: list[int] = []
        # roles as host offsets into buf.flat: t_sim (tensor, sum), resid (tensor, sum),
        # rms (tensor, sum, max, -min)
        self.tsim: list[tuple[int, int]] = []
        self.resid: list[tuple[int, int]] = []
        self.rms: list[tuple[int, int, int, int]] = []
        self.grad_norms: list[torch.Tensor] = []
        self.grad_offsets: list[int] = []
        # under sequence parallelism: per-sequence partials [rows, d + 2] and their (sum, count) offsets
        self.sp_partials: list[torch.Tensor] = []
        self.sp_offsets: list[tuple[int, int]] = []
        # the last tensor summarised: a sublayer's x is the previous sublayer's out (Post-Norm) or y
        # (Pre-Norm), the same tensor object, so its summary is reused
        self._last: tuple[torch.Tensor, int] | None = None
        # counts (sequences, tokens, hook calls) are host numbers: flat offset -> amount
        self.counts: dict[int, float] = defaultdict(float)

    def begin_step(self) -> None:
        self.pending.clear()
        self.sp_partials.clear()
        self.sp_offsets.clear()
        self.counts.clear()
        self._drop()

    def _drop(self) -> None:
        for held in (self.norms, self.row_sums, self.dims, self.tsim, self.resid, self.rms, self.grad_norms,
                     self.grad_offsets):
            held.clear()
        self._last = None

    def end_step(self) -> torch.Tensor | None:
        """Finish the step's statistics into the buffer and release its activations. Under sequence
        parallelism returns every kept partial as one [rows, d + 2] tensor (the same layout on every TP
        rank) for ``finish_sequence_parallel``."""
        self.flush()
        if self.counts:
            self._index_add(list(self.counts), torch.tensor(list(self.counts.values()), dtype=torch.float64))
        return torch.cat(self.sp_partials) if self.sp_partials else None

    # ---- listener ---------------------------------------------------------------------------
    def __call__(self, name: tuple[Any, ...], x: torch.Tensor | None = None, y: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, norm_in: torch.Tensor | None = None) -> None:
        if name[0] not in SITES and (name[0] != "layer" or name[1] not in self.buf.row):
            return  # an unselected layer or a probe this plugin does not know
        if not torch.is_grad_enabled():
            self.pending[name] += 1
            self._record(name, x, y, out, norm_in)
        elif not in_backward():
            self._record(name, x, y, out, norm_in)
            self._hook(name, x, y)
        elif self.pending[name] > 0:
            self.pending[name] -= 1
            self._hook(name, x, y)

    def _summary(self, t: torch.Tensor) -> int:
        """Index of ``t``'s summary (token norms and row sums), taken once per tensor."""
        if self._last is None or self._last[0] is not t:
            self.norms.append(token_norms(t))
            self.row_sums.append(t.sum(dim=1, dtype=accumulation_dtype(t)))
            self.dims.append(t.shape[-1])
            self._last = (t, len(self.norms) - 1)
        return self._last[1]

    def _room(self, tensors: list[torch.Tensor]) -> None:
        """Flush before a probe whose tensors would not stack with the kept summaries (or past the cap)."""
        if not self.norms:
            return
        first = self.norms[0]
        if len(self.norms) + len(tensors) > FLUSH_TENSORS or any(
                t.shape[:-1] != first.shape or accumulation_dtype(t) != first.dtype for t in tensors):
            self.flush()

    @torch.no_grad()
    def _record(self, name: tuple[Any, ...], x: torch.Tensor, y: torch.Tensor | None,
                out: torch.Tensor | None, norm_in: torch.Tensor | None) -> None:
        flat = self.buf.flat
        self._room([t for t in (x, y, out, norm_in) if t is not None])
        if name[0] in SITES:
            site = self.buf["site"][SITES.index(name[0])]
            self._add_tsim(self._summary(x), x.shape[0], site[0].storage_offset(), site[1].storage_offset())
            return
        _, layer, sublayer = name
        row = self.buf["sub"][self.buf.row[layer], SUBLAYERS.index(sublayer)]
        base = row.storage_offset() - flat.storage_offset()
        tensors = [t for t in (x, y, out) if t is not None]
        index = [self._summary(t) for t in tensors]
        for i, (t, k) in enumerate(zip(tensors, index, strict=True)):
            self._add_tsim(k, t.shape[0], base + COL["tsim_x"] + i, base + COL["n_x"] + i)
        self.resid.append((index[1], base + COL["resid"]))
        self.counts[base + COL["n_tok"]] += y.shape[0] * y.shape[1]
        if norm_in is None:  # no residual-stream RMSNorm (hybrid's FFN, DyT): the RMS factor stays null
            return
        u = next((k for t, k in zip(tensors, index, strict=True) if t is norm_in), None)
        if u is None:
            u = self._summary(norm_in)
        ext = self.buf["rms_ext"][self.buf.row[layer], SUBLAYERS.index(sublayer)]
        ext_base = ext.storage_offset() - flat.storage_offset()
        self.rms.append((u, base + COL["rms"], ext_base, ext_base + 1))
        self.counts[base + COL["n_rms"]] += norm_in.shape[0] * norm_in.shape[1]

    def _add_tsim(self, index: int, sequences: int, sum_offset: int, count_offset: int) -> None:
        """t_sim of summary ``index`` summed over its sequences into ``sum_offset``, counted at
        ``count_offset``; deferred to ``finish_sequence_parallel`` under sequence parallelism."""
        if self.sequence_parallel:
            self.sp_offsets.append((sum_offset, count_offset))
        else:
            self.counts[count_offset] += sequences
        self.tsim.append((index, sum_offset))

    def _hook(self, name: tuple[Any, ...], x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        if name[0] != "layer":
            return
        row = self.buf["sub"][self.buf.row[name[1]], SUBLAYERS.index(name[2])]
        base = row.storage_offset() - self.buf.flat.storage_offset()
        for tensor, col, count in ((x, COL["gx"], COL["n_gx"]), (y, COL["gy"], COL["n_gy"])):
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(_NormHook(self, base + col, base + count))

    # ---- the batched pass -----------------------------------------------------------------------
    @torch.no_grad()
    def flush(self) -> None:
        """Every kept summary and gradient norm finished into the buffer in one pass, then dropped."""
        if self.grad_norms:
            self._index_add(self.grad_offsets, torch.stack(self.grad_norms).double().square())
        if self.norms:
            self._finish_summaries()
        self._drop()

    def _finish_summaries(self) -> None:
        norms = torch.stack(self.norms)  # [T, b, s]
        sums = torch.stack(self.row_sums)  # [T, b, d]
        sq = norms.square().sum(-1)  # [T, b]: sum of squared token norms per sequence
        tensors, offsets = _columns(self.tsim, 2)
        if self.sequence_parallel:
            count = torch.full_like(sq, float(norms.shape[-1]))
            self.sp_partials.append(torch.cat([sums, sq[..., None], count[..., None]], -1)[tensors]
                                    .flatten(0, 1))
        else:
            tsim = sums.square().sum(-1) / (norms.shape[-1] * sq).clamp_min(EPS)
            self._index_add(offsets, tsim.sum(1)[_device(tensors, norms)])
        if self.resid:
            tensors, offsets = _columns(self.resid, 2)
            self._index_add(offsets, norms.sum((1, 2))[_device(tensors, norms)])
        if self.rms:
            tensors, total, high, low = _columns(self.rms, 4)
            dims = torch.tensor([math.sqrt(self.dims[k]) for k in tensors], dtype=norms.dtype)
            rms = dims.to(norms.device, non_blocking=True)[:, None, None] / \
                norms[_device(tensors, norms)].clamp_min(1e-30)
            self._index_add(total, rms.sum((1, 2)))
            low_high = torch.cat([rms.amax((1, 2)), -rms.amin((1, 2))]).double()
            flat = self.buf.flat
            flat.scatter_reduce_(0, _device(high + low, flat), low_high, "amax")

    # ---- sequence parallelism -------------------------------------------------------------------
    @torch.no_grad()
    def finish_sequence_parallel(self, summed: torch.Tensor) -> None:
        """Add the t_sim of the TP-summed partials (rows as returned by ``end_step``)."""
        row_sum, sq, count = summed[:, :-2], summed[:, -2], summed[:, -1]
        tsim = (row_sum.square().sum(-1) / (count * sq).clamp_min(EPS)).to(torch.float64)
        b = tsim.numel() // max(1, len(self.sp_offsets))
        sums, counts = _columns(self.sp_offsets, 2)
        self._index_add([o for o in sums for _ in range(b)], tsim)
        self._index_add([o for o in counts for _ in range(b)], torch.ones_like(tsim))

    def _index_add(self, offsets: list[int], values: torch.Tensor) -> None:
        """buf.flat[offsets] += values (host offsets and values are copied without a sync)."""
        flat = self.buf.flat
        flat.index_add_(0, _device(offsets, flat), values.to(flat.device, torch.float64, non_blocking=True))


def _columns(rows: list[tuple[int, ...]], n: int) -> tuple[list[int], ...]:
    return tuple(list(c) for c in zip(*rows, strict=True)) if rows else tuple([] for _ in range(n))


def _device(index: list[int], like: torch.Tensor) -> torch.Tensor:
    """A host index list on ``like``'s device (copied without a sync)."""
    return torch.tensor(index, dtype=torch.long).to(like.device, non_blocking=True)


class _NormHook:
    """Tensor hook: keeps ||grad||_F (>= fp32 reduction) for the step's batched pass, squared and added
    at ``offset`` there, and counts one call at ``count``; leaves the gradient unchanged."""

    def __init__(self, recorder: Recorder, offset: int, count: int) -> None:
        self.recorder, self.offset, self.count = recorder, offset, count

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor) -> None:
        self.recorder.grad_norms.append(norm(grad))
        self.recorder.grad_offsets.append(self.offset)
        self.recorder.counts[self.count] += 1
