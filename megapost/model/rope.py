"""Rotary position embedding (Llama's rotate-half convention)."""

from __future__ import annotations

import torch


def rope_cache(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos/sin tables of shape [seq_len, head_dim] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope_tables(cos: torch.Tensor, sin: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``apply_rope_tables`` takes, in ``dtype``: cos, and sin with its first half negated
    (so rotate-half becomes a swap of the halves: no negation kernel per call). Build once per dtype."""
    half = sin.shape[-1] // 2
    return cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)


def apply_rope_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, head_dim] by position in its own dtype (as Hugging Face's Llama does)
    from ``rope_tables``: three kernels (swap halves, x*cos, fused multiply-add) instead of eight."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [b, heads, s, head_dim] by position (fp32 ``rope_cache`` tables)."""
    return apply_rope_tables(x, *rope_tables(cos, sin, x.dtype))
