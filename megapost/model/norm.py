"""RMSNorm with a learned gain (apex's fused kernel when importable, else torch's F.rms_norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional fused kernel
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - apex is optional and often half-installed
    _ApexRMSNorm = None


class RMSNorm(nn.Module):
    """y = g * x / sqrt(mean(x^2) + eps), computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ApexRMSNorm is not None and x.is_cuda:
            from apex.normalization.fused_layer_norm import fused_rms_norm_affine  # type: ignore

            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        # torch computes in fp32 internally for bf16/fp16 inputs (bit-identical to upcasting first,
        # tested), without the casts' copies and their backward
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
