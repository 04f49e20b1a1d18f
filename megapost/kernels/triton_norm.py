"""Residual add + RMSNorm as one Triton kernel forward, registered as torch ops
(``megapost::add_rms_norm`` and ``megapost::add_rms_norm_backward``: one op each way to dispatch; two
kernels backward: the gradients, then the gain's from per-program partials). Where
``megapost.kernels.add_norm`` replaces CPU's composite, this is the CUDA path (``norm_path``): torch's
and apex's RMSNorm are one kernel each way there but leave the add apart.

Forward per row of [M, N]: y = round(round(a x) + r) in the input dtype (the unfused adds' roundings),
out = y / sqrt(mean(y^2) + eps) * g in fp32, stored in the input dtype; saves y and 1/rms (fp32).
Backward: n = y / rms, dy = round((g dout - n mean(g dout n)) / rms) + dy_other, dx = round(a dy); dg
accumulated in fp32 per program over its rows (grid-strided tiles of rows), the [programs, N] partials
summed by a second kernel that stores the gain's dtype. Not bit-identical to torch (reduction order; a
GPU may contract a x + r).

Triton is optional (``triton_common``); the kernels' bodies are in ``triton_kernels``."""

from __future__ import annotations

from typing import Any

import torch

from megapost.kernels.triton_common import cdiv, interpreted, jitted, programs, runs_on, torch_op


def norm_path(device: torch.device) -> str:
    """Which residual add + RMSNorm ``--kernel-fusion`` norm runs on ``device`` (the one place it is
    chosen): "triton" on CUDA when Triton imports (and on CPU tensors under ``TRITON_INTERPRET=1``),
    "torch" on CUDA without it (the add, then torch's or apex's fused RMSNorm: the unfused path),
    "function" elsewhere (``megapost.kernels.add_norm``, replacing torch's composite)."""
    if device.type == "cuda" or interpreted():
        return "triton" if runs_on(device) else "torch"
    return "function"


def _blocks(n: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: the row padded to a power of two, 4096 elements a tile."""
    import triton

    block_n = triton.next_power_of_2(n)
    return max(1, min(16, 4096 // block_n)), block_n


@torch_op("add_rms_norm(Tensor x, Tensor? r, Tensor weight, float eps, float scale) "
          "-> (Tensor, Tensor, Tensor)")
def _add_rms_norm_op(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, out, 1/rms per row): y = ``scale`` x + r ([0] without r), out = rmsnorm(y) * weight."""
    n = x.shape[-1]
    x2, weight = x.reshape(-1, n).contiguous(), weight.contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2) if r is not None else x2.new_empty(0)
    out, rstd = torch.empty_like(x2), torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_n = _blocks(n)
    # an unused pointer gets a live tensor of the right dtype (never read or written: constexpr branches)
    jitted("add_rms_norm_fwd")[(cdiv(m, block_m),)](
        x2, r.reshape(-1, n).contiguous() if r is not None else x2, weight, y if r is not None else out, out,
        rstd, m, n, eps, scale, HAS_R=r is not None, SCALED=scale != 1.0, BLOCK_M=block_m, BLOCK_N=block_n)
    return (y.view(x.shape) if r is not None else y), out.view(x.shape), rstd


@_add_rms_norm_op.register_fake
def _(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float,
      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    y = torch.empty_like(x) if r is not None else x.new_empty(0)
    return y, torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch_op("add_rms_norm_backward(Tensor y, Tensor weight, Tensor rstd, Tensor grad_out, Tensor? grad_y, "
          "float scale) -> (Tensor, Tensor, Tensor)")
def _backward_op(y: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_out: torch.Tensor,
                 grad_y: torch.Tensor | None,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, dx = round(``scale`` dy) ([0] when ``scale`` is 1), dweight)."""
    n = y.shape[-1]
    y2, weight = y.reshape(-1, n).contiguous(), weight.contiguous()  # y: x itself when there was no add
    m = y2.shape[0]
    dy = torch.empty_like(y2)
    dx = torch.empty_like(y2) if scale != 1.0 else y2.new_empty(0)
    block_m, block_n = _blocks(n)
    grid = programs(cdiv(m, block_m), y.device)
    dw = torch.empty(grid, n, dtype=torch.float32, device=y.device)
    go = grad_out.reshape(-1, n).contiguous()
    gy = grad_y.reshape(-1, n).contiguous() if grad_y is not None else go
    jitted("add_rms_norm_bwd")[(grid,)](
        y2, weight, rstd, go, gy, dy, dx if scale != 1.0 else dy, dw, m, n, scale, HAS_GY=grad_y is not None,
        SCALED=scale != 1.0, BLOCK_M=block_m, BLOCK_N=block_n)
    dweight = torch.empty_like(weight)
    # 32 partial rows a step on CUDA, 2 in the interpreter (so that the test's sum loops)
    jitted("column_sum")[(cdiv(n, 64),)](dw, dweight, grid, n, BLOCK_G=32 if y.is_cuda else 2, BLOCK_N=64)
    return dy.view(y.shape), (dx.view(y.shape) if scale != 1.0 else dx), dweight


@_backward_op.register_fake
def _(y: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_out: torch.Tensor,
      grad_y: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty_like(y) if scale != 1.0 else y.new_empty(0)
    return torch.empty_like(y), dx, torch.empty_like(weight)


class _TritonAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float,
                scale: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 if h is None else scale
        y, out, rstd = torch.ops.megapost.add_rms_norm(x, h, weight, eps, scale)
        ctx.save_for_backward(y if h is not None else x, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused output (Post-Norm's y) costs no zero-filled gradient
        ctx.has_h, ctx.scale = h is not None, scale
        return (y, out) if h is not None else out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grad_y, grad_out = grads if ctx.has_h else (None, grads[0])
        if grad_out is None:  # only y was used
            return grad_y if ctx.scale == 1.0 else grad_y * ctx.scale, grad_y, None, None, None
        y, weight, rstd = ctx.saved_tensors
        dy, dx, dw = torch.ops.megapost.add_rms_norm_backward(y, weight, rstd, grad_out, grad_y, ctx.scale)
        return (dy if ctx.scale == 1.0 else dx), (dy if ctx.has_h else None), dw, None, None


def triton_add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        scale: float = 1.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``megapost.kernels.add_rms_norm``'s contract ((y, out); out alone without ``h``) in Triton."""
    return _TritonAddRMSNorm.apply(x, h, weight, eps, scale)
