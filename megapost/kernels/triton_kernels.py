"""The Triton kernels of ``megapost.kernels.triton_norm`` and ``triton_rope`` as plain functions
(imported, and jitted by ``triton_common.jitted``, only when Triton is used; no ``from __future__ import
annotations``: Triton reads the annotations).

Sums are ``tl.reduce`` with this module's ``_add`` (not ``tl.sum``), zeros ``tl.full`` (not
``tl.zeros``): triton.language's jitted helpers are fixed when it is imported, so under
``TRITON_INTERPRET=1`` set later (a test) they would not run in the interpreter; builtins and ``_add``
(called through ``.fn``) do."""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


def add_rms_norm_fwd(X, R, W, Y, OUT, RSTD, M, N, eps, scale, HAS_R: tl.constexpr, SCALED: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    at = rows[:, None] * N + cols[None, :]
    y = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        if SCALED:
            y = (y * scale).to(X.dtype.element_ty).to(tl.float32)
        y = (y + tl.load(R + at, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Y + at, y, mask=mask)
        y = y.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(y * y, 1, _add) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = y * rstd[:, None] * w[None, :]
    tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < M)


def add_rms_norm_bwd(Y, W, RSTD, GO, GY, DY, DX, DW, M, N, scale, HAS_GY: tl.constexpr,
         SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_N], 0.0, tl.float32)
    for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        at = rows[:, None] * N + cols[None, :]
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
        n = tl.load(Y + at, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        go = tl.load(GO + at, mask=mask, other=0.0).to(tl.float32)
        gn = go * w[None, :]
        c = tl.reduce(gn * n, 1, _add) / N
        dy = ((gn - n * c[:, None]) * rstd[:, None]).to(DY.dtype.element_ty)
        if HAS_GY:
            dy = (dy.to(tl.float32) + tl.load(GY + at, mask=mask, other=0.0).to(tl.float32)).to(
                DY.dtype.element_ty)
        tl.store(DY + at, dy, mask=mask)
        if SCALED:
            tl.store(DX + at, (dy.to(tl.float32) * scale).to(DX.dtype.element_ty), mask=mask)
        dw += tl.reduce(go * n, 0, _add)
    tl.store(DW + pid * N + cols, dw, mask=cols < N)


def column_sum(P, OUT, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[n] = sum over the G rows of P[:, n] (fp32), stored in OUT's dtype: the dg partials' sum and
    its cast in one kernel."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < G) & (cols[None, :] < N)
        acc += tl.reduce(tl.load(P + rows[:, None] * N + cols[None, :], mask=mask, other=0.0), 0, _add)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=cols < N)
