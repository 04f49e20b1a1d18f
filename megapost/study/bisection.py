"""The collapse boundary lr*(d, L): bisection bookkeeping in log-lr and the power-law fit.

A grid point (width d, depth L) keeps a bracket [lo, hi] with P(collapse | lo) < 1/2 <= P(collapse | hi)
(estimated over seeds). Both ends are probed first; an end on the wrong side widens the bracket by
``widen`` in that direction (the end becomes the other end) until it brackets or would pass
``lr_min``/``lr_max`` (status below/above). Then ``steps`` bisection steps each probe the geometric
midpoint and keep the half that still brackets 1/2. The estimate is the bracket's geometric centre; its
interval is the bracket (the seed noise of each decision is reported with the probes, not folded in).

Fit: log lr* = a + b log d + c log L by least squares over the points with a finite bracket. Intervals
by Monte Carlo over the brackets: each draw puts every point's log lr* uniformly in its bracket and
refits; the 2.5/97.5 % quantiles of b and c are their intervals, and the stored draws give any
prediction's interval (``predict``). This midpoint fit is the bisection's own summary; the planner's law
is the maximum-likelihood fit over every probe's seeds (megapost-law boundary reads boundary.json).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def _round(lr: float) -> float:
    return float(f"{lr:.4g}")


@dataclass
class Bracket:
    width: int
    depth: int
    lo: float
    hi: float
    probes: list[dict[str, Any]] = field(default_factory=list)  # {"lr", "k", "n"} in probing order
    status: str = "open"  # open | below (lr* < lr_min: collapses there) | above (lr* > lr_max)
    steps: int = 2  # bisection steps once bracketed
    widen: float = 10.0  # factor an end moves by when it is on the wrong side
    lr_min: float = 1e-5
    lr_max: float = 1.0
    bisected: int = 0  # midpoints probed so far

    def record(self, lr: float, k: int, n: int) -> None:
        """The outcome of probing ``lr`` with n seeds, k collapsed: widens or narrows the bracket. A probe
        outside the current bracket (an old end after a widening) only joins the record."""
        self.probes.append({"lr": lr, "k": k, "n": n})
        collapses = 2 * k >= n
        if self.status != "open":
            return
        at_lo, at_hi = math.isclose(lr, self.lo), math.isclose(lr, self.hi)
        if at_lo and collapses:
            if self.lo / self.widen < self.lr_min * (1 - 1e-9):
                self.status = "below"
            else:
                self.lo, self.hi = _round(self.lo / self.widen), self.lo
        elif at_hi and not collapses:
            if self.hi * self.widen > self.lr_max * (1 + 1e-9):
                self.status = "above"
            else:
                self.lo, self.hi = self.hi, _round(self.hi * self.widen)
        elif self.lo < lr < self.hi and not (at_lo or at_hi):
            self.bisected += 1
            if collapses:
                self.hi = lr
            else:
                self.lo = lr

    def _seen(self, lr: float) -> bool:
        return any(math.isclose(lr, p["lr"]) for p in self.probes)

    def next_lrs(self) -> list[float]:
        """The lrs to probe next: unprobed ends first, then the geometric midpoint, ``steps`` times (none
        once not bracketed, or done)."""
        if self.status != "open":
            return []
        ends = [e for e in (self.lo, self.hi) if not self._seen(e)]
        if ends:
            return ends
        return [] if self.bisected >= self.steps else [_round(math.sqrt(self.lo * self.hi))]

    def rounds_left(self) -> int:
        """A lower bound on the probing rounds this point still needs."""
        if self.status != "open":
            return 0
        return int(any(not self._seen(e) for e in (self.lo, self.hi))) + self.steps - self.bisected

    @property
    def estimate(self) -> float:
        return math.sqrt(self.lo * self.hi)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "estimate": self.estimate if self.status == "open" else None}


def _design(widths: np.ndarray, depths: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(widths, dtype=float), np.log(widths), np.log(depths)], axis=1)


def fit_power_law(points: Sequence[Bracket], draws: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Least squares of log lr* on (1, log d, log L) at the brackets' centres, plus ``draws`` Monte Carlo
    refits with every log lr* uniform in its bracket. Needs >= 3 bracketed points; a grid with one width
    (or one depth) fits only the other exponent (the missing one is reported as None)."""
    pts = [p for p in points if p.status == "open"]
    if len(pts) < 2:
        raise ValueError(f"the fit needs >= 2 bracketed grid points, got {len(pts)}")
    w = np.array([p.width for p in pts], dtype=float)
    d = np.array([p.depth for p in pts], dtype=float)
    cols = [0] + [1] * (len(set(w)) > 1) + [2] * (len(set(d)) > 1)
    x = _design(w, d)[:, cols]
    lo, hi = np.log([p.lo for p in pts]), np.log([p.hi for p in pts])
    coef = np.linalg.lstsq(x, (lo + hi) / 2, rcond=None)[0]
    rng = np.random.default_rng(seed)
    ys = lo + (hi - lo) * rng.random((draws, len(pts)))
    samples = np.linalg.lstsq(x, ys.T, rcond=None)[0].T  # (draws, len(cols))
    full = np.zeros((draws, 3))
    full[:, cols] = samples
    point = np.zeros(3)
    point[cols] = coef

    def interval(i: int) -> list[float] | None:
        return [float(np.quantile(full[:, i], 0.025)), float(np.quantile(full[:, i], 0.975))] \
            if i in cols else None

    return {"log_a": float(point[0]), "b_width": float(point[1]) if 1 in cols else None,
            "c_depth": float(point[2]) if 2 in cols else None, "b_interval": interval(1),
            "c_interval": interval(2), "points": len(pts), "dof": len(pts) - len(cols),
            "samples": full[:: max(1, draws // 400)].round(6).tolist(),
            "range": {"widths": [float(w.min()), float(w.max())], "depths": [float(d.min()), float(d.max())]}}



def predict(fit: dict[str, Any], width: float, depth: float) -> dict[str, Any]:
    """lr*(width, depth) of ``fit_power_law``: point estimate, 95 % interval over the stored draws, and
    whether (width, depth) lies inside the fitted range."""
    x = np.array([1.0, math.log(width), math.log(depth)])
    coef = np.array([fit["log_a"], fit["b_width"] or 0.0, fit["c_depth"] or 0.0])
    vals = np.array(fit["samples"]) @ x
    r = fit["range"]
    inside = r["widths"][0] <= width <= r["widths"][1] and r["depths"][0] <= depth <= r["depths"][1]
    lo, hi = np.quantile(vals, [0.025, 0.975])
    return {"lr_star": math.exp(float(coef @ x)), "interval": [math.exp(float(lo)), math.exp(float(hi))],
            "inside": inside}
