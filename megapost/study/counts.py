"""Intervals and tests of counts (numpy-free): Wilson's interval of a proportion, the exact (Garwood)
interval of a Poisson count, the exact sign test of paired outcomes."""

from __future__ import annotations

import math
from typing import Any

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials ((nan, nan) for n = 0)."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _poisson_cdf(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean)."""
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return total


def poisson_interval(k: int, alpha: float = 0.05) -> tuple[float, float]:
    """The exact (Garwood) interval of a Poisson count k, by bisection on the Poisson CDF."""
    def solve(f: Any) -> float:  # f decreasing in the mean, root in [0, hi]
        lo, hi = 0.0, 10.0 + 10.0 * k
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda m: _poisson_cdf(k - 1, m) - (1 - alpha / 2))
    return lower, solve(lambda m: _poisson_cdf(k, m) - alpha / 2)


def sign_test(a: int, b: int) -> float:
    """Exact two-sided binomial p-value of a vs b discordant pairs under p = 1/2."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
