"""The norm placements as one table of per-sublayer rules, run by one formula (docs/placements.md).

Every sublayer k (attention, then FFN) of layer l, with input X (the residual stream), computes

    h   = F(s * N_in(X))      N_in only if ``input_norm``; s = ``input_scale``
    h   = N_out(h)            only if ``output_norm``
    Y   = a * X + h           a = ``residual_scale``
    out = N(Y)                only if ``post_norm``; the stream continues from out, else from Y

and the head applies a final norm unless the last sublayer already ended in one. N is RMSNorm, or
Dynamic Tanh under ``dyt`` (which also scales the embedding output by a learned scalar, init sqrt(d),
as the DyT paper's LLaMA models do). A placement is a function layer -> (attention rule, FFN rule); nothing
else in the model depends on its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLACEMENTS = ("post", "pre", "sandwich", "deepnorm", "mix", "hybrid", "pre-scaled", "dyt")


@dataclass(frozen=True)
class Sublayer:
    """One sublayer's dataflow (see the module docstring)."""

    input_norm: bool = False
    output_norm: bool = False
    post_norm: bool = False
    residual_scale: float = 1.0  # DeepNorm's alpha
    input_scale: float = 1.0  # LayerNorm Scaling's 1/sqrt(l)
    qkv_norm: bool = False  # attention only: HybridNorm's RMSNorm of Q, K and V per head

    @property
    def norm_input(self) -> str | None:
        """Which tensor the sublayer's residual-stream norm reads: "x", "y" or None (no such norm)."""
        return "y" if self.post_norm else "x" if self.input_norm else None


POST, PRE = Sublayer(post_norm=True), Sublayer(input_norm=True)


def deepnorm_constants(num_layers: int) -> tuple[float, float]:
    """DeepNet's decoder-only constants (Wang et al. 2022, Table 1 with M decoder layers):
    alpha = (2M)^(1/4) scales the residual, beta = (8M)^(-1/4) the init of W_V, W_O and the FFN."""
    return (2.0 * num_layers) ** 0.25, (8.0 * num_layers) ** -0.25


def mix_post_layers(num_layers: int, post_fraction: float) -> int:
    """Mix-LN: the first floor(rho * L) layers are Post-Norm, the rest Pre-Norm."""
    return math.floor(post_fraction * num_layers + 1e-9)


def layer_rules(placement: str, layer_number: int, num_layers: int,
                mix_post_fraction: float = 0.25) -> tuple[Sublayer, Sublayer]:
    """(attention rule, FFN rule) of 1-based ``layer_number`` under ``placement``."""
    if placement in ("post", "pre", "dyt"):
        rule = POST if placement == "post" else PRE
        return rule, rule
    if placement == "sandwich":
        rule = Sublayer(input_norm=True, output_norm=True)
        return rule, rule
    if placement == "deepnorm":
        rule = Sublayer(post_norm=True, residual_scale=deepnorm_constants(num_layers)[0])
        return rule, rule
    if placement == "mix":
        rule = POST if layer_number <= mix_post_layers(num_layers, mix_post_fraction) else PRE
        return rule, rule
    if placement == "hybrid":  # Y = X + Attn_QKVnorm(X); Z = N(Y); X' = Z + FFN(Z) (the code's form)
        return Sublayer(qkv_norm=True, post_norm=True), Sublayer()
    if placement == "pre-scaled":
        rule = Sublayer(input_norm=True, input_scale=1.0 / math.sqrt(layer_number))
        return rule, rule
    raise ValueError(f"--norm-position must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def has_final_norm(placement: str, num_layers: int, mix_post_fraction: float = 0.25) -> bool:
    """A final norm before the head unless the last sublayer's output is already normalised."""
    return not layer_rules(placement, num_layers, num_layers, mix_post_fraction)[1].post_norm


def norm_kind(placement: str) -> str:
    """"dyt" (Dynamic Tanh replaces every RMSNorm) or "rms"."""
    return "dyt" if placement == "dyt" else "rms"
