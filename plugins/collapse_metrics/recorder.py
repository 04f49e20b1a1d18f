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
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from .similarity import norm, sequence_partials, token_norms, tsim_from_partials
from .table import COL, SITES, SUBLAYERS, StatsBuffer


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
        # (flat offset of the first t_sim sum, flat offset of the first count, partials [m, b, d + 2])
        self.sequence_partials: list[tuple[int, int, torch.Tensor]] = []
        # the last tensor summarised: a sublayer's x is the previous sublayer's out (Post-Norm) or y
        # (Pre-Norm), the same tensor object, so its token norms and partials are reused
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # counts (sequences, tokens, hook calls) are host numbers: flat offset -> amount
        self.counts: dict[int, float] = defaultdict(float)

    def begin_step(self) -> None:
        self.pending.clear()
        self.sequence_partials.clear()
        self.counts.clear()
        self._last = None

    def end_step(self) -> torch.Tensor | None:
        """Add the host counts to the buffer and release the step's activations. Under sequence
        parallelism returns every kept partial as one [rows, d + 2] tensor (the same layout on every TP
        rank) for ``finish_sequence_parallel``."""
        self._last = None
        if self.counts:
            self._index_add(list(self.counts), torch.tensor(list(self.counts.values()), dtype=torch.float64))
        if not self.sequence_partials:
            return None
        return torch.cat([p.reshape(-1, p.shape[-1]) for _, _, p in self.sequence_partials])

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

    def _summary(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token norms, sequence partials) of ``t``."""
        if self._last is None or self._last[0] is not t:
            norms = token_norms(t)
            self._last = (t, norms, sequence_partials(t, norms))
        return self._last[1], self._last[2]

    @torch.no_grad()
    def _record(self, name: tuple[Any, ...], x: torch.Tensor, y: torch.Tensor | None,
                out: torch.Tensor | None, norm_in: torch.Tensor | None) -> None:
        if name[0] in SITES:
            site = self.buf["site"][SITES.index(name[0])]
            self._add_tsim(self._summary(x)[1][None], site[0:1], site[1:2])
            return
        _, layer, sublayer = name
        k = SUBLAYERS.index(sublayer)
        row = self.buf["sub"][self.buf.row[layer], k]
        tensors = [t for t in (x, y, out) if t is not None]
        norms, partials = zip(*(self._summary(t) for t in tensors), strict=True)
        m = len(tensors)
        self._add_tsim(torch.stack(partials), row[COL["tsim_x"]:COL["tsim_x"] + m],
                       row[COL["n_x"]:COL["n_x"] + m])
        row[COL["resid"]].add_(norms[1].sum())
        self.counts[row[COL["n_tok"]].storage_offset()] += norms[1].numel()
        if norm_in is None:  # no residual-stream RMSNorm (hybrid's FFN, DyT): the RMS factor stays null
            return
        u_norms = next((n for t, n in zip(tensors, norms, strict=True) if t is norm_in), None)
        if u_norms is None:
            u_norms = token_norms(norm_in)
        rms = math.sqrt(norm_in.shape[-1]) / u_norms.clamp_min(1e-30)
        row[COL["rms"]].add_(rms.sum())
        self.counts[row[COL["n_rms"]].storage_offset()] += rms.numel()
        ext = self.buf["rms_ext"][self.buf.row[layer], k]
        low, high = torch.aminmax(rms)
        torch.maximum(ext, torch.stack([high, -low]), out=ext)

    def _add_tsim(self, partials: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """Per-sequence t_sim of each of m tensors (partials [m, b, d + 2]) into ``sums`` (sum over
        sequences) and ``counts`` (views of m entries); deferred under sequence parallelism."""
        if self.sequence_parallel:
            self.sequence_partials.append((sums.storage_offset(), counts.storage_offset(), partials))
            return
        sums.add_(tsim_from_partials(partials).sum(1))
        for i in range(partials.shape[0]):
            self.counts[counts.storage_offset() + i] += partials.shape[1]

    def _hook(self, name: tuple[Any, ...], x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        if name[0] != "layer":
            return
        row = self.buf["sub"][self.buf.row[name[1]], SUBLAYERS.index(name[2])]
        for tensor, col, count in ((x, COL["gx"], COL["n_gx"]), (y, COL["gy"], COL["n_gy"])):
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(_SquaredNormHook(row[col], self.counts, row[count].storage_offset()))

    # ---- sequence parallelism -------------------------------------------------------------------
    @torch.no_grad()
    def finish_sequence_parallel(self, summed: torch.Tensor) -> None:
        """Add the t_sim of the TP-summed partials (rows as returned by ``end_step``)."""
        tsim = tsim_from_partials(summed).to(torch.float64)
        sum_idx, count_idx = [], []
        for sum_off, count_off, p in self.sequence_partials:
            m, b = p.shape[:2]
            sum_idx += [sum_off + i for i in range(m) for _ in range(b)]
            count_idx += [count_off + i for i in range(m) for _ in range(b)]
        self._index_add(sum_idx, tsim)
        self._index_add(count_idx, torch.ones_like(tsim))

    def _index_add(self, offsets: list[int], values: torch.Tensor) -> None:
        """buf.flat[offsets] += values (host offsets and values are copied without a sync)."""
        flat = self.buf.flat
        flat.index_add_(0, torch.tensor(offsets).to(flat.device, non_blocking=True),
                        values.to(flat.device, non_blocking=True))


class _SquaredNormHook:
    """Tensor hook: ``total += ||grad||_F^2`` (>= fp32 reduction) and one call counted at ``offset``;
    leaves the gradient unchanged."""

    def __init__(self, total: torch.Tensor, counts: dict[int, float], offset: int) -> None:
        self.total, self.counts, self.offset = total, counts, offset

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor) -> None:
        self.total.add_(norm(grad).square())
        self.counts[self.offset] += 1
