"""SwiGLU feed-forward: (SiLU(x W_1) * (x W_3)) W_2; W_1 and W_3 as one GEMM and the gate as one fused
Function (on CUDA a Triton kernel) where ``fusion`` says so (megapost.model.fusion)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapost.kernels import packed_linear, swiglu_packed, swiglu_path, triton_swiglu
from megapost.model.config import ModelConfig
from megapost.model.fusion import Fusion, packable_weights


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.fusion = Fusion()  # megapost.model.fusion.set_kernel_fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eager = not torch.compiler.is_compiling()
        weights = packable_weights(self.w1, self.w3) if eager and self.fusion.on("w13", x.dtype) else None
        if weights is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        h13 = packed_linear(x, weights)  # [..., 2f]: this rank's W_1 rows, then its W_3 rows
        if self.fusion.on("swiglu", x.dtype):
            triton = swiglu_path(h13.device) == "triton" and self.fusion.triton_on("swiglu", x.dtype)
            return self.w2((triton_swiglu if triton else swiglu_packed)(h13))
        h1, h3 = h13.chunk(2, dim=-1)
        return self.w2(F.silu(h1) * h3)
