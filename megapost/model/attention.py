"""Causal multi-head attention with RoPE, fused SDPA and the prefix-averaging intervention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import apply_rope, rope_cache


def causal_running_mean(v: torch.Tensor) -> torch.Tensor:
    """C_n V along the sequence (dim -2): row i is the mean of v_1..v_i."""
    counts = torch.arange(1, v.shape[-2] + 1, device=v.device, dtype=torch.float32).unsqueeze(-1)
    return (v.float().cumsum(dim=-2) / counts).to(v.dtype)


class Attention(nn.Module):
    """softmax(QK^T/sqrt(d_h)) V W_O per head; heads are inferred from the projection width, so a
    tensor-parallel wrapper can shard W_Q/W_K/W_V by columns and W_O by rows without changes here."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.prefix_alpha = cfg.prefix_alpha
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self._rope: tuple[torch.Tensor, ...] | None = None

    def _rope_tables(self, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        if self._rope is None or self._rope[0].shape[0] < seq or self._rope[0].device != device:
            self._rope = rope_cache(seq, self.head_dim, self.rope_theta, device)
        return self._rope[0][:seq], self._rope[1][:seq]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        cos, sin = self._rope_tables(q.shape[2], x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.prefix_alpha:
            out = out - self.prefix_alpha * causal_running_mean(v)
        out = out.transpose(1, 2).reshape(b, q.shape[2], -1)
        return self.wo(out)
