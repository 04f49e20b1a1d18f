"""Initialization-time surrogate of token-similarity growth (QUANTITIES.md, Thm 3.2, Cor 3.3, Thm 3.4).

Plain numpy. All closed forms assume the equal-correlation closure
R_eq(t) = d[(1 - rho) I + rho 1 1^T], rho(t) = (n t - 1)/(n - 1), prefix averaging C_n for attention
and the ratio-of-expectations surrogate E t_sim(Y) ~ E||Pi Y||_F^2 / E||Y||_F^2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np
from numpy.polynomial.hermite_e import hermegauss

ArrayLike = float | np.ndarray


def harmonic(n: int) -> float:
    """H_n = sum_{k=1}^n 1/k."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return float(np.sum(1.0 / np.arange(1, n + 1, dtype=np.float64)))


def rho_of_t(t: ArrayLike, n: int) -> ArrayLike:
    """Equal-correlation coefficient rho(t) = (n t - 1)/(n - 1)."""
    return (n * np.asarray(t, dtype=np.float64) - 1.0) / (n - 1.0)


# ----------------------------------------------------------------------------------------------- attention
def attention_f1(t: ArrayLike, n: int) -> ArrayLike:
    """f1(t) = (1 - t)(n - H_n)(n t + 1) / (n (n - 1))."""
    t = np.asarray(t, dtype=np.float64)
    h = harmonic(n)
    return (1.0 - t) * (n - h) * (n * t + 1.0) / (n * (n - 1.0))


def attention_f2(t: ArrayLike, n: int) -> ArrayLike:
    """f2(t) = B(t) = [(n - H_n) t + H_n - 1] / (n - 1)."""
    t = np.asarray(t, dtype=np.float64)
    h = harmonic(n)
    return ((n - h) * t + h - 1.0) / (n - 1.0)


def attention_a(t: ArrayLike, n: int) -> ArrayLike:
    """A(t) = tr(Pi C R_eq C^T)/(n d) = [(1 - rho)(2n - H_n) + rho n^2] / n^2."""
    rho = rho_of_t(t, n)
    return ((1.0 - rho) * (2.0 * n - harmonic(n)) + rho * n * n) / (n * n)


def attention_b(t: ArrayLike, n: int) -> ArrayLike:
    """B(t) = tr(C R_eq C^T)/(n d) = [(1 - rho) H_n + rho n] / n."""
    rho = rho_of_t(t, n)
    return ((1.0 - rho) * harmonic(n) + rho * n) / n


def attention_next_tsim(s: ArrayLike, t: ArrayLike, n: int) -> ArrayLike:
    """Thm 3.2: E t_sim(X + C_n X W) ~ (t + s A(t)) / (1 + s B(t))."""
    s = np.asarray(s, dtype=np.float64)
    return (np.asarray(t, dtype=np.float64) + s * attention_a(t, n)) / (1.0 + s * attention_b(t, n))


def attention_delta(s: ArrayLike, t: ArrayLike, n: int) -> ArrayLike:
    """Thm 3.2: Delta_attn(s, t) = s f1(t) / (1 + s f2(t)) (equals attention_next_tsim - t)."""
    s = np.asarray(s, dtype=np.float64)
    return s * attention_f1(t, n) / (1.0 + s * attention_f2(t, n))


def intervention_delta(s: ArrayLike, t: ArrayLike, n: int, alpha: ArrayLike) -> ArrayLike:
    """Cor 3.3: attention P -> P - alpha C_n scales s by (1 - alpha)^2 in the surrogate."""
    return attention_delta((1.0 - np.asarray(alpha, dtype=np.float64)) ** 2 * np.asarray(s), t, n)


def amount_of_attention(n: int, d: int, sigma_w2: ArrayLike, x_fro_sq: ArrayLike) -> ArrayLike:
    """s = n d^2 sigma_W^2 / ||X||_F^2 (sigma_W^2: entry variance of W = W_V W_O)."""
    return n * d * d * np.asarray(sigma_w2, dtype=np.float64) / np.asarray(x_fro_sq, dtype=np.float64)


def sigma_w2_from_heads(d: int, sigma_v2: float, sigma_o2: float) -> float:
    """Entry variance of W = W_V W_O (inner dimension d over all heads): sigma_W^2 = d sigma_V^2 sigma_O^2."""
    return d * sigma_v2 * sigma_o2


# ----------------------------------------------------------------------------------------------- SwiGLU
@lru_cache(maxsize=8)
def _gauss_hermite(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilists' Gauss-Hermite nodes and weights normalised so that sum(w) = 1 (E over N(0,1))."""
    x, w = hermegauss(num_nodes)
    return x, w / np.sqrt(2.0 * np.pi)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def silu_correlation(rho: ArrayLike, v: float, num_nodes: int = 80) -> ArrayLike:
    """m(rho) = E[SiLU(u) SiLU(u')], (u, u') ~ N(0, v [[1, rho], [rho, 1]]), by 2-D Gauss-Hermite.

    u = sqrt(v) z1, u' = sqrt(v)(rho z1 + sqrt(1 - rho^2) z2), z1, z2 iid N(0, 1). Vectorised over rho;
    v = d sigma_W1^2 (1/3 in the paper's scheme: m(0) ~ 0.006, m(1) ~ 0.100).
    """
    rho_arr = np.asarray(rho, dtype=np.float64)
    if np.any(np.abs(rho_arr) > 1.0 + 1e-12):
        raise ValueError("rho must lie in [-1, 1]")
    flat = np.clip(rho_arr.reshape(-1), -1.0, 1.0)
    x, w = _gauss_hermite(num_nodes)
    sv = np.sqrt(v)
    a = _silu(sv * x) * w  # weighted outer factor over z1, shape [N]
    out = np.empty_like(flat)
    chunk = max(1, 2**20 // (num_nodes * num_nodes))
    for i in range(0, flat.size, chunk):
        r = flat[i:i + chunk, None, None]
        inner = _silu(sv * (r * x[:, None] + np.sqrt(1.0 - r * r) * x[None, :]))  # [c, N(z1), N(z2)]
        out[i:i + chunk] = np.einsum("i,cij,j->c", a, inner, w)
    return out.reshape(rho_arr.shape) if rho_arr.ndim else float(out[0])


def ffn_xi(d: int, d_ff: int, sigma_w2_sq: float, sigma_w3_sq: float) -> float:
    """xi = d d_ff sigma_W2^2 sigma_W3^2."""
    return d * d_ff * sigma_w2_sq * sigma_w3_sq


def ffn_delta(xi: ArrayLike, t: ArrayLike, n: int, v: float, num_nodes: int = 80) -> ArrayLike:
    """Thm 3.4: Delta_FFN = xi (t - 1/n)(m(rho(t)) - m(1)) / (1 + xi m(1))  (<= 0), v = d sigma_W1^2."""
    xi = np.asarray(xi, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    m1 = silu_correlation(1.0, v, num_nodes)
    m_rho = silu_correlation(np.clip(rho_of_t(t, n), -1.0, 1.0), v, num_nodes)
    return xi * (t - 1.0 / n) * (m_rho - m1) / (1.0 + xi * m1)


# ----------------------------------------------------------------------------------------------- depth curves
@dataclass(frozen=True)
class InitVariances:
    """Entry variances at init. sigma_q2/sigma_k2 do not enter the surrogate (P is replaced by C_n)."""

    sigma_q2: float
    sigma_k2: float
    sigma_v2: float
    sigma_o2: float
    sigma_w1_2: float
    sigma_w3_2: float
    sigma_w2_2: float
    sigma_embed2: float

    def sigma_w2(self, d: int) -> float:
        """Entry variance of W = W_V W_O."""
        return sigma_w2_from_heads(d, self.sigma_v2, self.sigma_o2)


def paper_init_variances(d: int, d_ff: int, multiplier: float = 1.0) -> InitVariances:
    """The paper's scheme: 1/(3d) for every matrix, 1/(3 d_ff) for W_2; sublayer matrices x multiplier.

    The embedding (not a sublayer matrix) keeps 1/(3d), as in megapost.model.init.matrix_std.
    """
    a = multiplier / (3.0 * d)
    return InitVariances(a, a, a, a, a, a, multiplier / (3.0 * d_ff), 1.0 / (3.0 * d))


@dataclass(frozen=True)
class TsimCurve:
    """Per-layer predictions (index l = 0 .. L-1 is layer l + 1)."""

    t_attn: np.ndarray  # t_sim before the attention sublayer
    delta_attn: np.ndarray
    t_ffn: np.ndarray  # t_sim before the FFN sublayer
    delta_ffn: np.ndarray
    s: np.ndarray  # amount of attention used at each layer
    xi: np.ndarray  # effective xi used at each layer
    x1_fro_sq: np.ndarray = field(repr=False)  # ||X_1^l||_F^2 used (or modelled)
    x2_fro_sq: np.ndarray = field(repr=False)  # ||X_2^l||_F^2 used (or modelled)

    @property
    def t_out(self) -> np.ndarray:
        """t_sim after each layer."""
        return self.t_ffn + self.delta_ffn


def predicted_tsim_curve(
    t0: float,
    num_layers: int,
    n: int,
    d: int,
    d_ff: int,
    variances: InitVariances,
    norm_position: Literal["post", "pre"] = "post",
    x_fro_sq_per_layer: np.ndarray | None = None,
    x2_fro_sq_per_layer: np.ndarray | None = None,
    embed_fro_sq: float | None = None,
    alpha: float = 0.0,
    num_nodes: int = 80,
) -> TsimCurve:
    """Iterate t <- t + Delta_attn(s^l, t) (Thm 3.2 / Cor 3.3), then t <- t + Delta_FFN(xi^l, t) (Thm 3.4).

    Post-Norm: every sublayer input has row norm^2 d (attention on the raw embeddings is homogeneous in
    X), so s = d sigma_W^2 and xi = d d_ff sigma_W2^2 sigma_W3^2 at every layer; the RMSNorm step is
    not modelled (it leaves t_sim unchanged for equal row norms). Measured norms are ignored.
    Pre-Norm: the sublayer sees RMSNorm(X) (row norm^2 d, same t_sim under equal row norms), so
    s^l = n d^2 sigma_W^2 / ||X_1^l||_F^2 and, by the same derivation, xi^l = xi n d / ||X_2^l||_F^2.
    ||X_k^l||_F^2 is taken from ``x_fro_sq_per_layer`` / ``x2_fro_sq_per_layer`` (measured, length L)
    when supplied; otherwise from the surrogate's own expected growth (the denominators of the ratio):
        ||X_1^1||^2 = embed_fro_sq (default n d sigma_embed^2),
        ||X_2^l||^2 = ||X_1^l||^2 + n d (1 - alpha)^2 d sigma_W^2 B(t)   (attention adds E||C N(X) W||^2),
        ||X_1^{l+1}||^2 = ||X_2^l||^2 + n d xi m(1)                      (SwiGLU adds E||FFN(N(X))||^2),
    i.e. roughly linear growth in l (Xiong et al., 2020), hence s^l ~ d sigma_W^2 / l.
    ``alpha`` applies the Cor 3.3 intervention P -> P - alpha C_n to every layer.
    """
    if norm_position not in ("post", "pre"):
        raise ValueError(f"norm_position must be 'post' or 'pre', got {norm_position!r}")
    pre = norm_position == "pre"
    sigma_w = variances.sigma_w2(d)
    xi0 = ffn_xi(d, d_ff, variances.sigma_w2_2, variances.sigma_w3_2)
    v = d * variances.sigma_w1_2
    m1 = float(silu_correlation(1.0, v, num_nodes))
    nd = float(n * d)
    x1_meas = _per_layer(x_fro_sq_per_layer, num_layers)
    x2_meas = _per_layer(x2_fro_sq_per_layer, num_layers)
    out = {k: np.empty(num_layers) for k in ("t_attn", "d_attn", "t_ffn", "d_ffn", "s", "xi", "x1", "x2")}
    t = float(t0)
    x1 = nd * variances.sigma_embed2 if embed_fro_sq is None else float(embed_fro_sq)
    for layer in range(num_layers):
        if not pre:
            x1 = nd
        elif x1_meas is not None:
            x1 = float(x1_meas[layer])
        s = float(amount_of_attention(n, d, sigma_w, x1))
        da = float(intervention_delta(s, t, n, alpha))
        x2 = x1 + nd * (1.0 - alpha) ** 2 * d * sigma_w * float(attention_b(t, n))
        if not pre:
            x2 = nd
        elif x2_meas is not None:
            x2 = float(x2_meas[layer])
        xi = xi0 * nd / x2
        df = float(ffn_delta(xi, t + da, n, v, num_nodes))
        for key, val in zip(out, (t, da, t + da, df, s, xi, x1, x2), strict=True):
            out[key][layer] = val
        t = t + da + df
        x1 = x2 + nd * xi0 * m1
    return TsimCurve(out["t_attn"], out["d_attn"], out["t_ffn"], out["d_ffn"], out["s"], out["xi"],
                     out["x1"], out["x2"])


def _per_layer(values: np.ndarray | None, num_layers: int) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != (num_layers,):
        raise ValueError(f"per-layer norms must have shape ({num_layers},), got {arr.shape}")
    return arr
