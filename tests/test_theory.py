"""Closed forms of collapse_metrics.analysis.theory against Monte Carlo simulations of their own
assumptions."""

from __future__ import annotations

import numpy as np
import pytest
from collapse_metrics.analysis.theory import (
    InitVariances,
    amount_of_attention,
    attention_a,
    attention_b,
    attention_delta,
    attention_next_tsim,
    ffn_delta,
    ffn_xi,
    harmonic,
    intervention_delta,
    paper_init_variances,
    predicted_tsim_curve,
    rho_of_t,
    sigma_w2_from_heads,
    silu_correlation,
)

Z_TOL = 4.0  # Monte Carlo tolerance in standard errors


def equal_correlation_x(n: int, d: int, t: float, rng: np.random.Generator) -> np.ndarray:
    """X (n x d) with Gram exactly R_eq(t) = d[(1 - rho) I + rho 1 1^T]: X = L Q^T, L L^T = R_eq."""
    rho = rho_of_t(t, n)
    r_eq = d * ((1.0 - rho) * np.eye(n) + rho * np.ones((n, n)))
    lam, vec = np.linalg.eigh(r_eq)
    l_fac = vec * np.sqrt(np.clip(lam, 0.0, None))
    q, _ = np.linalg.qr(rng.standard_normal((d, n)))  # orthonormal n-frame in R^d
    return l_fac @ q.T


def prefix_average(n: int) -> np.ndarray:
    """C_n: (C_n)_ij = 1/i for j <= i."""
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def ratio_of_means(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """mean(num)/mean(den) and its delta-method standard error."""
    r = num.mean() / den.mean()
    se = np.sqrt(np.var(num - r * den, ddof=1) / num.size) / den.mean()
    return float(r), float(se)


def tsim_parts(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """||Pi Y||_F^2 = n ||mean row||^2 and ||Y||_F^2 over a leading batch axis."""
    n = y.shape[-2]
    return n * np.sum(y.mean(axis=-2) ** 2, axis=-1), np.sum(y**2, axis=(-2, -1))


def mc_attention(n: int, d: int, t: float, s: float, draws: int, seed: int, alpha: float = 0.0):
    rng = np.random.default_rng(seed)
    x = equal_correlation_x(n, d, t, rng)
    assert np.allclose(np.sum(x**2, axis=1), d) and np.isclose(tsim_parts(x)[0] / (n * d), t)
    m = (1.0 - alpha) * prefix_average(n) @ x  # (P - alpha C_n) X with P = C_n
    sigma = np.sqrt(s / d)  # Post-Norm: s = d sigma_W^2
    num, den = [], []
    for start in range(0, draws, 100):
        b = min(100, draws - start)
        w = sigma * rng.standard_normal((d, b * d))  # b draws of W side by side: one GEMM for all
        a, q = tsim_parts(x + (m @ w).reshape(n, b, d).transpose(1, 0, 2))
        num.append(a)
        den.append(q)
    return ratio_of_means(np.concatenate(num), np.concatenate(den))


# (n, d, t0, s, closed form from QUANTITIES.md or None)
ATTN_CASES = [
    (64, 256, 1 / 64, 1.0, 0.0426),
    (64, 256, 0.1, 5.0, 0.3769),
    (64, 256, 0.3, 1.0, 0.4549),
    (64, 256, 0.6, 5.0, 0.8812),
    (64, 256, 0.9, 0.2, 0.9146),
    (16, 32, 0.05, 2.0, None),
    (8, 64, 0.5, 0.5, None),
]


@pytest.mark.parametrize(("n", "d", "t", "s", "table"), ATTN_CASES)
def test_attention_closed_form_matches_monte_carlo(n: int, d: int, t: float, s: float, table: float | None):
    closed = float(attention_next_tsim(s, t, n))
    if table is not None:
        assert abs(closed - table) < 1e-3
    mc, se = mc_attention(n, d, t, s, draws=300, seed=ATTN_CASES.index((n, d, t, s, table)))
    assert se < 0.01
    assert abs(mc - closed) < Z_TOL * se + 1e-9, (mc, se, closed)


def test_intervention_matches_monte_carlo():
    n, d, t, s, alpha = 32, 64, 0.2, 3.0, 0.5
    mc, se = mc_attention(n, d, t, s, draws=400, seed=7, alpha=alpha)
    closed = t + float(intervention_delta(s, t, n, alpha))
    assert abs(mc - closed) < Z_TOL * se, (mc, se, closed)


def test_attention_identities():
    n = 37
    c = prefix_average(n)
    pi = np.full((n, n), 1.0 / n)
    assert np.isclose(np.sum(c**2), harmonic(n))
    assert np.isclose(np.sum((pi @ c) ** 2), 2 - harmonic(n) / n)
    d, t = 5.0, 0.3
    rho = rho_of_t(t, n)
    r_eq = d * ((1 - rho) * np.eye(n) + rho * np.ones((n, n)))
    assert np.isclose(np.trace(pi @ c @ r_eq @ c.T) / (n * d), attention_a(t, n))
    assert np.isclose(np.trace(c @ r_eq @ c.T) / (n * d), attention_b(t, n))
    ts = np.linspace(0.0, 1.0, 11)
    ss = np.array([0.1, 1.0, 10.0])[:, None]
    np.testing.assert_allclose(attention_next_tsim(ss, ts, n) - ts, attention_delta(ss, ts, n), atol=1e-14)


def test_attention_limits():
    n, s = 64, 2.5
    h = harmonic(n)
    assert attention_delta(s, 1.0, n) == pytest.approx(0.0, abs=1e-15)
    known = s * 2 * (n - h) / n**2 / (1 + s * h / n)  # rho = 0: f1 = 2(n - H)/n^2, f2 = H/n
    assert attention_delta(s, 1.0 / n, n) == pytest.approx(known, rel=1e-12)
    assert intervention_delta(s, 0.3, n, 1.0) == 0.0
    assert intervention_delta(s, 0.3, n, 0.0) == attention_delta(s, 0.3, n)
    assert intervention_delta(s, 0.3, n, 0.5) == pytest.approx(attention_delta(s / 4, 0.3, n))
    # large n: logistic form s t (1 - t) / (1 + s t)
    big = 200_000
    assert attention_delta(s, 0.4, big) == pytest.approx(s * 0.4 * 0.6 / (1 + s * 0.4), rel=1e-3)


def test_silu_correlation_paper_values_and_exact_limits():
    v = 1.0 / 3.0
    m = silu_correlation(np.array([0.0, 1.0]), v)
    assert m[0] == pytest.approx(0.006, abs=5e-4) and m[1] == pytest.approx(0.100, abs=1e-3)
    assert silu_correlation(0.5, v, 40) == pytest.approx(silu_correlation(0.5, v, 120), abs=1e-12)
    assert np.ndim(silu_correlation(0.2, v)) == 0 and silu_correlation(np.zeros((2, 3)), v).shape == (2, 3)
    integrate = pytest.importorskip("scipy.integrate")
    phi = lambda z: np.exp(-z * z / 2) / np.sqrt(2 * np.pi)
    silu = lambda z, a: a * z / (1 + np.exp(-a * z))
    for var in (v, 2.0):
        mean = integrate.quad(lambda z, a: silu(z, a) * phi(z), -40, 40, args=(np.sqrt(var),))[0]
        second = integrate.quad(lambda z, a: silu(z, a) ** 2 * phi(z), -40, 40, args=(np.sqrt(var),))[0]
        assert silu_correlation(0.0, var) == pytest.approx(mean**2, rel=1e-8)
        assert silu_correlation(1.0, var) == pytest.approx(second, rel=1e-8)


@pytest.mark.parametrize("v", [1.0 / 3.0, 2.0])
def test_silu_correlation_matches_monte_carlo(v: float):
    rng = np.random.default_rng(3)
    z1, z2 = rng.standard_normal((2, 400_000))
    silu = lambda u: u / (1 + np.exp(-u))
    for rho in (-0.7, 0.0, 0.4, 0.95):
        prod = silu(np.sqrt(v) * z1) * silu(np.sqrt(v) * (rho * z1 + np.sqrt(1 - rho**2) * z2))
        se = prod.std() / np.sqrt(prod.size)
        assert abs(prod.mean() - silu_correlation(rho, v)) < Z_TOL * se


def mc_ffn(n: int, d: int, d_ff: int, t: float, s1: float, s3: float, s2: float, draws: int, seed: int):
    rng = np.random.default_rng(seed)
    x = equal_correlation_x(n, d, t, rng)
    num, den = [], []
    for start in range(0, draws, 200):
        b = min(200, draws - start)
        a1 = (x @ (np.sqrt(s1) * rng.standard_normal((d, b * d_ff)))).reshape(n, b, d_ff).transpose(1, 0, 2)
        a3 = (x @ (np.sqrt(s3) * rng.standard_normal((d, b * d_ff)))).reshape(n, b, d_ff).transpose(1, 0, 2)
        h = a1 / (1 + np.exp(-a1)) * a3
        y = x + h @ (np.sqrt(s2) * rng.standard_normal((b, d_ff, d)))
        p, q = tsim_parts(y)
        num.append(p)
        den.append(q)
    return ratio_of_means(np.concatenate(num), np.concatenate(den))


# (n, d, d_ff, t, sigma_W1^2 d = v, xi)
FFN_CASES = [(16, 64, 128, 0.3, 1 / 3, 4.0), (16, 64, 128, 0.6, 1.0, 2.0), (8, 32, 96, 0.1, 2.0, 1.0)]


@pytest.mark.parametrize(("n", "d", "d_ff", "t", "v", "xi"), FFN_CASES)
def test_ffn_closed_form_matches_monte_carlo(n: int, d: int, d_ff: int, t: float, v: float, xi: float):
    s1, s3 = v / d, 1.0 / d
    s2 = xi / (d * d_ff * s3)
    assert ffn_xi(d, d_ff, s2, s3) == pytest.approx(xi)
    closed = t + float(ffn_delta(xi, t, n, v))
    mc, se = mc_ffn(n, d, d_ff, t, s1, s3, s2, draws=1000, seed=n + d)
    assert se < 0.005
    assert abs(mc - closed) < Z_TOL * se, (mc, se, closed)
    assert (closed - t) * (t - 1.0 / n) < 0  # damping above t = 1/n (rho > 0), the converse below


def test_ffn_limits_and_paper_scale():
    n, v = 64, 1.0 / 3.0
    assert ffn_delta(0.5, 1.0, n, v) == pytest.approx(0.0, abs=1e-15)
    assert ffn_delta(0.5, 1.0 / n, n, v) == pytest.approx(0.0, abs=1e-15)
    ts = np.linspace(1.0 / n, 1.0, 50)
    d = ffn_delta(1.0 / 9.0, ts, n, v)
    assert np.all(d <= 1e-15) and np.min(d) > -(1.0 / 9.0) * 0.1


def test_variance_helpers_and_paper_scheme():
    d, d_ff, n = 512, 1536, 2048
    iv = paper_init_variances(d, d_ff)
    assert iv.sigma_w2(d) == pytest.approx(1.0 / (9.0 * d))
    assert sigma_w2_from_heads(d, iv.sigma_v2, iv.sigma_o2) == iv.sigma_w2(d)
    assert ffn_xi(d, d_ff, iv.sigma_w2_2, iv.sigma_w3_2) == pytest.approx(1.0 / 9.0)
    assert amount_of_attention(n, d, iv.sigma_w2(d), n * d) == pytest.approx(1.0 / 9.0)
    iv4 = paper_init_variances(d, d_ff, multiplier=4.0)
    assert iv4.sigma_w2(d) == pytest.approx(16.0 / (9.0 * d)) and iv4.sigma_embed2 == iv.sigma_embed2


def test_predicted_curve_post_and_pre():
    n, d, d_ff, layers = 128, 64, 192, 12
    iv = paper_init_variances(d, d_ff, multiplier=3.0)
    post = predicted_tsim_curve(0.02, layers, n, d, d_ff, iv, "post")
    np.testing.assert_allclose(post.s, d * iv.sigma_w2(d))
    np.testing.assert_allclose(post.t_ffn, post.t_attn + post.delta_attn)
    np.testing.assert_allclose(post.t_attn[1:], post.t_out[:-1])
    assert np.all(post.delta_attn > 0) and np.all(post.delta_ffn <= 0) and np.all(np.diff(post.t_out) > 0)
    assert post.delta_attn[0] == pytest.approx(attention_delta(post.s[0], 0.02, n))
    pre = predicted_tsim_curve(0.02, layers, n, d, d_ff, iv, "pre")
    assert np.all(np.diff(pre.s) < 0) and np.all(np.diff(pre.x1_fro_sq) > 0)
    ratio = pre.s[-1] * pre.x1_fro_sq[-1] / (n * d)  # s^l = d sigma_W^2 (n d / ||X||^2)
    assert ratio == pytest.approx(d * iv.sigma_w2(d))
    norms = n * d * (1.0 + np.arange(layers))
    meas = predicted_tsim_curve(0.02, layers, n, d, d_ff, iv, "pre", x_fro_sq_per_layer=norms)
    np.testing.assert_allclose(meas.s, d * iv.sigma_w2(d) / (1.0 + np.arange(layers)))
    off = predicted_tsim_curve(0.02, layers, n, d, d_ff, iv, "post", alpha=1.0)
    assert np.all(off.delta_attn == 0.0)
    custom = InitVariances(0, 0, 1 / d, 2 / d, 1 / (3 * d), 1 / d, 1 / d_ff, 1 / d)
    assert predicted_tsim_curve(0.02, 2, n, d, d_ff, custom).s[0] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        predicted_tsim_curve(0.02, layers, n, d, d_ff, iv, "pre", x_fro_sq_per_layer=norms[:-1])
