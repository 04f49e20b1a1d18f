"""One transformer layer; its norm placement is a pair of rules from megapost.model.placements
(dataflow of every placement: docs/placements.md; Post/Pre: shared/paper/QUANTITIES.md)."""

from __future__ import annotations

import torch
from torch import nn

from megapost.model.attention import Attention
from megapost.model.config import ModelConfig
from megapost.model.mlp import SwiGLU
from megapost.model.norm import RMSNorm, make_norm
from megapost.model.placements import Sublayer
from megapost.model.probe import Probe


class TransformerBlock(nn.Module):
    """Post-Norm: Y1 = X1 + Attn(X1); X2 = N1(Y1); Y2 = X2 + FFN(X2); out = N2(Y2).
    Pre-Norm:  Y1 = X1 + Attn(N1(X1)); X2 = Y1;    Y2 = X2 + FFN(N2(X2)); out = Y2.
    Other placements: the rules' one formula (``placements`` module docstring).

    ``attention_norm`` / ``mlp_norm`` are each sublayer's residual-stream norm (before the sublayer or
    after the add, as its rule says; None when it has none), ``*_out_norm`` the sandwich output norms.
    Each sublayer reports ``x`` (its input X_k), ``y`` (the residual sum Y_k), ``out`` (the normalised
    output when the stream is normalised after the add, else None) and ``norm_in`` (the tensor its
    RMSNorm sees; None without one, or under DyT) to a probe. ``layer_number`` is 1-based.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.attn_rule, self.ffn_rule = cfg.rules(layer_number)
        self.attention = Attention(cfg, qkv_norm=self.attn_rule.qkv_norm)
        self.mlp = SwiGLU(cfg)
        alpha_attn, alpha_other = cfg.dyt_alpha_init

        def norm(rule: Sublayer, slot: str, alpha: float) -> nn.Module | None:
            wanted = rule.norm_input is not None if slot == "stream" else rule.output_norm
            return make_norm(cfg.norm_kind, cfg.hidden_size, cfg.norm_eps, alpha) if wanted else None

        self.attention_norm = norm(self.attn_rule, "stream", alpha_attn)
        self.attention_out_norm = norm(self.attn_rule, "out", alpha_other)
        self.mlp_norm = norm(self.ffn_rule, "stream", alpha_other)
        self.mlp_out_norm = norm(self.ffn_rule, "out", alpha_other)
        self.measures_rms = cfg.norm_kind == "rms"
        self.probe_attn = Probe(("layer", layer_number, "attn"))
        self.probe_ffn = Probe(("layer", layer_number, "ffn"))

    @staticmethod
    def _add(x: torch.Tensor, h: torch.Tensor, scale: float, norm: nn.Module | None,
             observed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Y = scale * x + h, norm(Y) or None); RMSNorm fuses the add in (``RMSNorm(x, h, scale)``)
        unless a probe listener sees Y: a hook on Y must see its whole gradient, which the fused
        Function keeps inside (bit-identical either way)."""
        if isinstance(norm, RMSNorm) and not observed:
            return norm(x, h, scale)
        y = x + h if scale == 1.0 else x * scale + h
        return y, (norm(y) if norm is not None else None)

    def _sublayer(self, x: torch.Tensor, rule: Sublayer, fn: nn.Module, norm: nn.Module | None,
                  out_norm: nn.Module | None, probe: Probe, normed: torch.Tensor | None = None,
                  next_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the stream after the sublayer, ``next_norm`` of it when given and the stream is not
        normalised here); ``normed``: this sublayer's input norm of ``x``, computed by the previous add."""
        h = x
        if rule.input_norm:
            h = normed if normed is not None else norm(h)
            if rule.input_scale != 1.0:
                h = h * rule.input_scale
        h = fn(h)
        if out_norm is not None:
            h = out_norm(h)
        y, out = self._add(x, h, rule.residual_scale, norm if rule.post_norm else next_norm,
                           observed=probe.listener is not None)
        norm_in = {"x": x, "y": y}.get(rule.norm_input) if self.measures_rms else None
        probe(x=x, y=y, out=out if rule.post_norm else None, norm_in=norm_in)
        return (out, None) if rule.post_norm else (y, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the attention's add and the FFN's input norm in one call (Pre-Norm, sandwich)
        next_norm = self.mlp_norm if self.ffn_rule.input_norm else None
        x, normed = self._sublayer(x, self.attn_rule, self.attention, self.attention_norm,
                                   self.attention_out_norm, self.probe_attn, next_norm=next_norm)
        return self._sublayer(x, self.ffn_rule, self.mlp, self.mlp_norm, self.mlp_out_norm, self.probe_ffn,
                              normed=normed)[0]
