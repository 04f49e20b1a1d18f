"""The delayed-collapse law: a discrete-time hazard in the current learning rate, fitted by maximum
likelihood over every run's step-by-step survival (numpy only).

A run that learned is at risk from the step it learned (a results.csv row without its series: from step
0) to its event or its censoring step (``events``). Per step t its hazard of collapsing is

    lambda(t) = exp(eta),  eta = b0 + beta log lr(t) + gamma g(tau(t)) + sum_f c_f log(x_f / ref_f)

with lr(t) the lr the run actually had at t (its schedule), tau(t) the steps since the end of warmup
(time since peak; g: ``none``, ``log1p`` log(1 + tau/100) or ``linear`` tau/1000), and x the width,
depth, warmup (as log(1 + warmup/100)) and tokens per step B (a term only for those that vary in the data;
as log B, or saturating past a critical batch B_c as log(B / (1 + B / B_c)) -- B_c one of ``SAT_GRID``,
counted as a parameter in the AIC: gradient noise falls as 1/B only up to the critical batch; and its
limit B_c -> 0, the term 1 - 256 / B, linear in the gradient noise's variance, with no B_c: ``INVERSE``).
The seed is the noise: the event time of one seed is random given lambda. Steps are grouped in
``DELTA``-step intervals (complementary log-log likelihood: P(event in an interval of n steps) = 1 -
exp(-n lambda)), lr(t) and tau(t) taken at each interval's middle step. Fisher scoring (Newton) with step
halving; a 1e-3 ridge on the factor terms keeps a factor with no event at one of its values finite; the
coefficients' covariance is the inverse observed information.

For a planned run (factors x, schedule s) the cumulative hazard to its last step is lr^beta A(x, s), so
P(collapse) = 1 - exp(-lr^beta A) and the delayed-collapse lr* (P = 1/2) is (ln 2 / A)^(1/beta).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megapost.study.events import DELAYED, Event
from megapost.utils.lr_schedule import lr_at

FACTORS = ("width", "depth", "warmup", "tokens_per_step")
REF = {"width": 64.0, "depth": 4.0, "warmup": 500.0, "tokens_per_step": 256.0}
TIME_FORMS = ("none", "log1p", "linear")
SAT_GRID = (128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)  # B_c of the saturating forms
INVERSE = -1.0  # ``sat`` of the limit B_c -> 0: the tokens term 1 - ref / B (no B_c to choose)
DELTA = 5
RIDGE = 1e-3


def factor_term(f: str, v: float, sat: float = 0.0) -> float:
    """A factor's design entry: log(v / ref); warmup log((1 + v/100) / (1 + ref/100)) (0 steps allowed);
    tokens per step with ``sat`` > 0: log of v / (1 + v / sat) over the same at ref."""
    if f == "warmup":
        return math.log1p(v / 100.0) - math.log1p(REF[f] / 100.0)
    if f == "tokens_per_step" and sat == INVERSE:
        return 1.0 - REF[f] / v
    if f == "tokens_per_step" and sat > 0:
        return math.log(v / (1.0 + v / sat)) - math.log(REF[f] / (1.0 + REF[f] / sat))
    return math.log(v / REF[f])


@dataclass(frozen=True)
class Schedule:
    """The lr a run had: peak ``lr``, ``min_lr`` (absolute), warmup, total steps, decay style."""

    lr: float
    min_lr: float
    warmup: int
    train_iters: int
    style: str

    def at(self, steps: np.ndarray) -> np.ndarray:
        return np.array([lr_at(int(s), self.lr, self.min_lr, self.warmup, self.train_iters, self.style)
                         for s in steps])

    def shape(self, steps: np.ndarray) -> np.ndarray:
        """lr(t) / lr (min_lr scaled with the peak)."""
        return np.array([lr_at(int(s), 1.0, self.min_lr / self.lr, self.warmup, self.train_iters, self.style)
                         for s in steps])


@dataclass(frozen=True)
class HazardRun:
    """One run that learned: its configuration (key and factors), schedule, outcome, first step at risk."""

    config: str
    x: Mapping[str, float]
    schedule: Schedule
    event: Event
    entry: int
    seed: int = 0


@dataclass(frozen=True)
class HForm:
    """Which factors have a term, the time-since-peak term's shape and the tokens term's critical batch
    (``sat``; 0: a plain power law)."""

    factors: tuple[str, ...]
    time: str = "log1p"
    sat: float = 0.0

    @property
    def name(self) -> str:
        tail = (f"; tokens/step saturating at {self.sat:,.0f}" if self.sat > 0
                else "; tokens/step as gradient noise (256 / B)" if self.sat == INVERSE else "")
        return f"time {self.time}; factors {', '.join(self.factors) or 'none'}{tail}"

    @property
    def extra_params(self) -> int:
        """Parameters chosen outside the likelihood's Newton fit (the critical batch), for the AIC."""
        return 1 if self.sat > 0 else 0

    def columns(self) -> list[str]:
        return (["const", "log lr"] + ([f"time:{self.time}"] if self.time != "none" else [])
                + [self.term_name(f) for f in self.factors])

    def term_name(self, f: str) -> str:
        if f == "tokens_per_step" and self.sat == INVERSE:
            return "1 - 256 / tokens_per_step"
        if f == "tokens_per_step" and self.sat > 0:
            return f"log tokens_per_step / (1 + tokens_per_step / {self.sat:.0f})"
        return f"log {f}"

    def design(self, log_lr: np.ndarray, tau: np.ndarray, x: Mapping[str, float]) -> np.ndarray:
        cols = [np.ones_like(log_lr), log_lr]
        if self.time == "log1p":
            cols.append(np.log1p(tau / 100.0))
        elif self.time == "linear":
            cols.append(tau / 1000.0)
        cols += [np.full_like(log_lr, factor_term(f, float(x[f]), self.sat)) for f in self.factors]
        return np.stack(cols, axis=1)

    def as_dict(self) -> dict[str, Any]:
        return {"factors": list(self.factors), "time": self.time, "sat": self.sat}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HForm:
        if d["time"] not in TIME_FORMS:
            raise ValueError(f"time form {d['time']!r} not in {TIME_FORMS}")
        return cls(tuple(d["factors"]), d["time"], float(d.get("sat", 0.0)))


def exposure(run: HazardRun) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(log lr, tau, steps, event) per interval of the run's time at risk."""
    start, stop = run.entry, max(run.entry, run.event.at_risk_until)
    starts = np.arange(start, stop, DELTA)
    if len(starts) == 0:
        return (np.zeros(0),) * 4  # type: ignore[return-value]
    ends = np.minimum(starts + DELTA, stop)
    mid = (starts + ends - 1) // 2
    event = np.zeros(len(starts))
    if run.event.kind == DELAYED:
        event[-1] = 1.0
    tau = np.maximum(0, mid - run.schedule.warmup).astype(float)
    return np.log(run.schedule.at(mid)), tau, (ends - starts).astype(float), event


def stack(runs: Sequence[HazardRun], form: HForm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs, ns, ys = [], [], []
    for r in runs:
        log_lr, tau, n, y = exposure(r)
        if len(n):
            xs.append(form.design(log_lr, tau, r.x))
            ns.append(n)
            ys.append(y)
    return np.concatenate(xs), np.concatenate(ns), np.concatenate(ys)


def _loglik_parts(z: np.ndarray, n: np.ndarray, y: np.ndarray, theta: np.ndarray):
    mu = n * np.exp(np.clip(z @ theta, -60, 30))
    em1 = np.expm1(mu)
    ll = np.where(y > 0, np.log(-np.expm1(-mu)), -mu)
    g = np.where(y > 0, mu / np.where(em1 > 0, em1, 1e-300), -mu)
    h = np.where(y > 0, mu * (em1 - mu * (em1 + 1)) / np.where(em1 > 0, em1 * em1, 1e-300), -mu)
    return float(ll.sum()), z.T @ g, (z * h[:, None]).T @ z


def _penalty(p: int) -> np.ndarray:
    d = np.full(p, RIDGE)
    d[:2] = 0.0  # no ridge on the constant and the lr slope
    return np.diag(d)


def fit(runs: Sequence[HazardRun], form: HForm, iters: int = 200) -> HazardFit:
    """Maximum-likelihood fit of ``form`` over the runs' intervals."""
    z, n, y = stack(runs, form)
    if y.sum() == 0:
        raise ValueError("no delayed collapse in the data: the hazard has no scale")
    pen = _penalty(z.shape[1])
    theta = np.zeros(z.shape[1])
    theta[0] = math.log(y.sum() / n.sum())
    ll, g, h = _loglik_parts(z, n, y, theta)
    obj = ll - theta @ pen @ theta
    for _ in range(iters):
        step = np.linalg.solve(-(h - 2 * pen), g - 2 * pen @ theta)
        for _half in range(40):
            new = theta + step
            nll, ng, nh = _loglik_parts(z, n, y, new)
            nobj = nll - new @ pen @ new
            if nobj >= obj - 1e-10:
                break
            step = step / 2
        done = abs(nobj - obj) < 1e-9
        theta, obj, ll, g, h = new, nobj, nll, ng, nh
        if done:
            break
    cov = np.linalg.inv(-(h - 2 * pen))
    return HazardFit(form, theta, cov, ll, int(y.sum()), len(runs))


@dataclass
class HazardFit:
    form: HForm
    theta: np.ndarray
    cov: np.ndarray
    loglik: float
    events: int
    runs: int

    @property
    def params(self) -> int:
        return len(self.theta) + self.form.extra_params

    @property
    def aic(self) -> float:
        return 2 * self.params - 2 * self.loglik

    def as_dict(self) -> dict[str, Any]:
        return {"form": self.form.as_dict(), "columns": self.form.columns(), "theta": self.theta.tolist(),
                "cov": self.cov.tolist(), "loglik": self.loglik, "events": self.events, "runs": self.runs}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HazardFit:
        form = HForm.from_dict(d["form"])
        theta, cov = np.array(d["theta"], float), np.array(d["cov"], float)
        if theta.shape != (len(form.columns()),) or cov.shape != (len(theta), len(theta)):
            raise ValueError(f"theta/cov do not match the form's {len(form.columns())} columns")
        return cls(form, theta, cov, float(d["loglik"]), int(d["events"]), int(d["runs"]))


def log_a(thetas: np.ndarray, form: HForm, x: Mapping[str, float], sched: Schedule,
          entry: int = 0) -> np.ndarray:
    """log A(x, s) per parameter row of ``thetas``: the cumulative hazard at peak lr 1 from ``entry`` to the
    schedule's last step (in DELTA-step intervals)."""
    starts = np.arange(entry, sched.train_iters, DELTA)
    ends = np.minimum(starts + DELTA, sched.train_iters)
    mid = (starts + ends - 1) // 2
    z = form.design(np.log(np.maximum(sched.shape(mid), 1e-300)),
                    np.maximum(0, mid - sched.warmup).astype(float), x)
    eta = np.atleast_2d(thetas) @ z.T + np.log(ends - starts)[None, :]
    top = eta.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(eta - top).sum(axis=1, keepdims=True)))[:, 0]


def log_lr_star(thetas: np.ndarray, form: HForm, x: Mapping[str, float], sched: Schedule) -> np.ndarray:
    """log lr* (P(collapse by the last step) = 1/2) per parameter row."""
    t = np.atleast_2d(thetas)
    return (math.log(math.log(2.0)) - log_a(t, form, x, sched)) / t[:, 1]


def p_collapse(thetas: np.ndarray, form: HForm, x: Mapping[str, float], sched: Schedule) -> np.ndarray:
    """P(collapse by the schedule's last step) at its peak lr, per parameter row."""
    t = np.atleast_2d(thetas)
    return -np.expm1(-np.exp(t[:, 1] * math.log(sched.lr) + log_a(t, form, x, sched)))


def draws(fit: HazardFit, count: int, seed: int) -> np.ndarray:
    """Parameter draws from the fit's normal approximation (the first row: the estimate)."""
    rng = np.random.default_rng(seed)
    out = rng.multivariate_normal(fit.theta, fit.cov, size=count, method="eigh")
    out[0] = fit.theta
    return out[out[:, 1] > 0]
