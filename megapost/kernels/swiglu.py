"""SwiGLU's gate, silu(h_1) * h_3, on the packed output [..., 2f] of one W_1/W_3 GEMM, as an autograd
Function that saves only that input and recomputes silu(h_1) in backward. Autograd's graph of the same
expression keeps h_1, silu(h_1) and h_3 (3f per token) and joins the two input gradients with a ``cat``;
this keeps 2f and writes both gradients into one [..., 2f] buffer. The same ops per element as autograd's
(mul, mul, silu_backward): bit-identical given the same input."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h13: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h13)
        h1, h3 = h13.chunk(2, dim=-1)
        return F.silu(h1) * h3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (h13,) = ctx.saved_tensors
        h1, h3 = h13.chunk(2, dim=-1)
        out = torch.empty_like(h13)
        d1, d3 = out.chunk(2, dim=-1)
        torch.mul(grad, F.silu(h1), out=d3)
        torch.ops.aten.silu_backward.grad_input(grad * h3, h1, grad_input=d1)
        return out


def swiglu_packed(h13: torch.Tensor) -> torch.Tensor:
    """silu(h13[..., :f]) * h13[..., f:] for ``h13`` = x [W_1; W_3]^T."""
    return _SwiGLUPacked.apply(h13)
