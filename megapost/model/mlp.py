"""SwiGLU feed-forward: (SiLU(x W_1) * (x W_3)) W_2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapost.model.config import ModelConfig


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
