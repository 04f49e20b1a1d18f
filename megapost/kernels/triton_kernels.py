"""The Triton kernels of ``megapost.kernels.triton_norm``, ``triton_rope`` and ``triton_swiglu`` as plain
functions (imported, and jitted by ``triton_common.jitted``, only when Triton is used; no ``from
__future__ import annotations``: Triton reads the annotations).

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


def rope_rows(X, COS, SSIN, Y, R, S, H, sxb, sxs, sxh, HALF, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Rows (b, s, h) of x [B, S, H, 2 HALF] (strides sxb, sxs, sxh; the last one 1) rotated by the
    tables [S, 2 HALF] into the contiguous Y. Forward y = x cos + swap(x) ssin, the first product
    rounded apart (``torch.addcmul(x * cos, ...)``); backward dx = g cos + swap(g ssin), both products
    rounded apart (``megapost.kernels.rope``'s backward)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < HALF)
    b = rows // (S * H)
    s = (rows // H) % S
    at = (b * sxb + s * sxs + (rows % H) * sxh)[:, None] + cols[None, :]
    tab = (s * 2 * HALF)[:, None] + cols[None, :]
    x1 = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + at + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + tab, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + tab + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SSIN + tab, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SSIN + tab + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    if BACKWARD:
        y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s1).to(dt).to(tl.float32)
    else:
        y1 = (x1 * c1).to(dt).to(tl.float32) + x2 * s1
        y2 = (x2 * c2).to(dt).to(tl.float32) + x1 * s2
    out = rows[:, None] * 2 * HALF + cols[None, :]
    tl.store(Y + out, y1.to(dt), mask=mask)
    tl.store(Y + out + HALF, y2.to(dt), mask=mask)


def swiglu_rows(H, G, OUT, M, F, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """SwiGLU's gate on the rows [h1 | h3] of H [M, 2F] (contiguous), each op in fp32 and rounded to the
    storage dtype as torch rounds it. Forward OUT [M, F] = round(round(silu(h1)) h3) (``F.silu(h1) * h3``;
    G unused). Backward, for the output gradient G [M, F]: OUT [M, 2F] = [dh1 | dh3] with dh3 =
    round(g round(silu(h1))), dh1 = torch's ``silu_backward(round(g h3), h1)`` = round(g h3) sig (1 + h1
    (1 - sig))."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    at = rows[:, None] * 2 * F + cols[None, :]
    h1 = tl.load(H + at, mask=mask, other=0.0).to(tl.float32)
    h3 = tl.load(H + at + F, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    s = (h1 / (1.0 + tl.exp(-h1))).to(dt).to(tl.float32)
    if BACKWARD:
        g = tl.load(G + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-h1))
        gh3 = (g * h3).to(dt).to(tl.float32)
        tl.store(OUT + at, (gh3 * sig * (1.0 + h1 * (1.0 - sig))).to(dt), mask=mask)
        tl.store(OUT + at + F, (g * s).to(dt), mask=mask)
    else:
        tl.store(OUT + rows[:, None] * F + cols[None, :], (s * h3).to(dt), mask=mask)


def rope_qkv_bwd(DQ, DK, DV, COS, SSIN, Y, R, S, NQ, NK, qb, qs, qh, kb, ks, kh, vb, vs, vh, HALF,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The packed Q/K/V gradient Y [B, S, NQ + 2 NK, 2 HALF] (contiguous) from dq [B, S, NQ, .], dk and
    dv [B, S, NK, .] (any strides, the last 1): q's and k's heads rotated back as ``rope_rows``'
    backward, v's copied. Each row reads one source (masked loads of the other two)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    heads = NQ + 2 * NK
    h = rows % heads
    s = (rows // heads) % S
    b = rows // (S * heads)
    mask = (rows[:, None] < R) & (cols[None, :] < HALF)
    in_q = (h < NQ)[:, None] & mask
    in_k = ((h >= NQ) & (h < NQ + NK))[:, None] & mask
    in_v = (h >= NQ + NK)[:, None] & mask
    at_q = (b * qb + s * qs + tl.minimum(h, NQ - 1) * qh)[:, None] + cols[None, :]
    at_k = (b * kb + s * ks + tl.minimum(tl.maximum(h - NQ, 0), NK - 1) * kh)[:, None] + cols[None, :]
    at_v = (b * vb + s * vs + tl.maximum(h - NQ - NK, 0) * vh)[:, None] + cols[None, :]
    x1 = (tl.load(DQ + at_q, mask=in_q, other=0.0) + tl.load(DK + at_k, mask=in_k, other=0.0)
          + tl.load(DV + at_v, mask=in_v, other=0.0)).to(tl.float32)
    x2 = (tl.load(DQ + at_q + HALF, mask=in_q, other=0.0) + tl.load(DK + at_k + HALF, mask=in_k, other=0.0)
          + tl.load(DV + at_v + HALF, mask=in_v, other=0.0)).to(tl.float32)
    tab = (s * 2 * HALF)[:, None] + cols[None, :]
    c1 = tl.load(COS + tab, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + tab + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SSIN + tab, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SSIN + tab + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s1).to(dt).to(tl.float32)
    out = rows[:, None] * 2 * HALF + cols[None, :]
    tl.store(Y + out, tl.where(in_v, x1, y1).to(dt), mask=mask)
    tl.store(Y + out + HALF, tl.where(in_v, x2, y2).to(dt), mask=mask)
