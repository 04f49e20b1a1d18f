"""One transformer layer with the norm-placement switch (dataflow: shared/paper/QUANTITIES.md)."""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .mlp import SwiGLU
from .norm import RMSNorm
from .probe import Probe


class TransformerBlock(nn.Module):
    """Post-Norm: Y1 = X1 + Attn(X1); X2 = N1(Y1); Y2 = X2 + FFN(X2); out = N2(Y2).
    Pre-Norm:  Y1 = X1 + Attn(N1(X1)); X2 = Y1;    Y2 = X2 + FFN(N2(X2)); out = Y2.

    Each sublayer reports ``x`` (its input X_k), ``y`` (the residual sum Y_k), ``out`` (Post-Norm's
    normalised output, else None) and ``norm_in`` (the tensor its RMSNorm sees) to a probe.
    ``layer_number`` is 1-based, as in the paper.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.post = cfg.norm_position == "post"
        self.attention = Attention(cfg)
        self.mlp = SwiGLU(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.probe_attn = Probe(("layer", layer_number, "attn"))
        self.probe_ffn = Probe(("layer", layer_number, "ffn"))

    def _sublayer(self, x: torch.Tensor, fn: nn.Module, norm: nn.Module, probe: Probe) -> torch.Tensor:
        if self.post:
            y = x + fn(x)
            out = norm(y)
            probe(x=x, y=y, out=out, norm_in=y)
            return out
        y = x + fn(norm(x))
        probe(x=x, y=y, out=None, norm_in=x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._sublayer(x, self.attention, self.attention_norm, self.probe_attn)
        return self._sublayer(x, self.mlp, self.mlp_norm, self.probe_ffn)
