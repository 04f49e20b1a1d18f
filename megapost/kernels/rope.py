"""Rotary position embedding (rotate-half) as one autograd Function: three ops forward (swap the
halves, x*cos, one multiply-add) and three backward, where autograd's graph of the same expression
dispatches eight (the cat's backward is two zero-filled ``slice_backward`` copies and their adds).
Bit-identical to ``megapost.model.rope.apply_rope_tables`` forward and backward in fp32 on CPU (the
same products and one add per element; tested)."""

from __future__ import annotations

from typing import Any

import torch


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((t[..., half:], t[..., :half]), dim=-1)


class _Rope(torch.autograd.Function):
    """y = x * cos + swap(x) * signed_sin; dx = g * cos + swap(g * signed_sin)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(x * cos, _swap_halves(x), signed_sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        # mul + add, not addcmul: autograd's backward rounds the product and the sum apart (CPU's
        # addcmul fuses them); accumulated into g * cos, which has the gradient's memory layout as
        # autograd's result does (a norm's weight gradient below reduces in layout order)
        return (grad * cos).add_(_swap_halves(grad * signed_sin)), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., head_dim] by the tables of ``megapost.model.rope.rope_tables`` (broadcast
    against ``x``: [s, head_dim] for [b, heads, s, head_dim], [s, 1, head_dim] for [b, s, heads,
    head_dim]); the tables take no gradient."""
    return _Rope.apply(x, cos, signed_sin)
