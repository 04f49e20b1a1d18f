"""Residual add + RMSNorm as one autograd Function: (y, out) = (a * x + h, g * y / rms(y)), the norm in
fp32 (the input's dtype out). Post-Norm's ``N(X + F(X))`` and, under Pre-Norm / sandwich, a sublayer's
add followed by the next sublayer's input norm; without ``h`` it is the plain RMSNorm.

For torch's composite ``F.rms_norm`` (what CPU runs; CUDA has the fused ``_fused_rms_norm`` kernel
each way already). The forward is the composite's own ops (pow, mean, add_, rsqrt, mul, mul, and the
casts); the backward is autograd's formula with its full-size detours folded into the per-row factor:
mean's backward divides a full [.., h] tensor, pow's computes ``2 * y.pow(1)`` and multiplies twice,
rsqrt's scales by -0.5; here one [.., 1] factor ``(dr * r^3) / -h`` times y (exact: only powers of two
move between the factors). 11 ops backward instead of 14 (fp32; bf16 also its 3 casts), the same
saved tensors (fp32 input, 1/rms, fp32 normalised input), bit-identical to autograd's graph of ``x + h``
and ``F.rms_norm`` forward and backward in fp32 and bf16 (tested)."""

from __future__ import annotations

from typing import Any

import torch


def _lead_dims(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(t.dim() - 1))


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float,
                scale: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 if h is None else scale
        y = x if h is None else (x + h if scale == 1.0 else x * scale + h)
        up = y.float() if y.dtype != torch.float32 else y
        r = up.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt()
        n = up.mul(r)
        out = n.mul(weight).contiguous()  # the composite's output is contiguous (a strided input: a copy)
        ctx.save_for_backward(up, r, n, weight)
        ctx.set_materialize_grads(False)  # an unused output (Post-Norm's y) costs no zero-filled gradient
        ctx.dtype, ctx.has_h, ctx.scale = y.dtype, h is not None, scale
        out = out.to(y.dtype)
        return (y, out) if h is not None else out  # y is x without h: not returned (no alias)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grad_y, grad_out = grads if ctx.has_h else (None, grads[0])
        if grad_out is None:  # only y was used
            return grad_y if ctx.scale == 1.0 else grad_y * ctx.scale, grad_y, None, None, None
        up, r, n, weight = ctx.saved_tensors
        g = grad_out.float() if grad_out.dtype != torch.float32 else grad_out
        gn = g * weight
        gw = (g * n).sum(_lead_dims(g)).to(weight.dtype) if ctx.needs_input_grad[2] else None
        gup = gn * r
        factor = (gn * up).sum(-1, keepdim=True).mul(r.pow(3)).div(-up.shape[-1])
        # autograd's order: y's other gradient first (fp32: summed with the three norm terms as they
        # arrive; bf16: after their fp32 sum is cast)
        fp32 = ctx.dtype == torch.float32
        if grad_y is not None and fp32:
            gup = grad_y + gup
        dy = (gup + factor * up).to(ctx.dtype)
        if grad_y is not None and not fp32:
            dy = dy + grad_y
        dx = dy if ctx.scale == 1.0 else dy * ctx.scale
        return dx, (dy if ctx.has_h else None), gw, None, None


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, out): y = ``scale`` * x + h (x itself without ``h``), out = ``F.rms_norm(y, [d], weight,
    eps)``, as one autograd Function (module docstring). Either output may go unused."""
    return _AddRMSNorm.apply(x, h, weight, eps, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, [d], weight, eps)`` as the same Function without the add."""
    return _AddRMSNorm.apply(x, None, weight, eps, 1.0)
