"""The delayed-collapse law as a file: the best hazard fit (``hazard``) and the alternatives its interval
carries, and the predictions the planner and the guard read.

The JSON (schema "megapost.hazard_law", version 1; docs/study_results.md):

    criterion    the outcome thresholds (``events.Criterion.describe``)
    best         {form, columns, theta, cov, loglik, events, runs}: the fit by AIC
    alternatives [{kind: "label" | "form" | "influence", name, fit}]: refits under another label threshold
                 (events.ALTERNATIVES), the other forms (time-since-peak term, dropping a factor's term),
                 and leaving out one configuration at a time; a prediction's interval is the envelope
                 of the best, form and label branches' parameter intervals and the influence refits'
                 estimates (a refit's own interval would count the left-out data's loss, not influence)
    box          {factor: [min, max]} over the fitted runs
    level        0.95;  draws: parameter draws per branch;  provenance
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megapost.study.boundary_law import read_box, with_validation
from megapost.study.hazard import FACTORS, HazardFit, Schedule, draws, log_lr_star, p_collapse
from megapost.utils.atomic import atomic_write_text

SCHEMA, VERSION = "megapost.hazard_law", 1
SHIPPED = Path(__file__).with_name("hazard_law_post.json")
UNINFORMATIVE = 10.0  # wider than this ratio: no P(collapse) is printed
DRAWS = 1000


@dataclass
class Branch:
    kind: str
    name: str
    fit: HazardFit

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "fit": self.fit.as_dict()}


@dataclass
class Spread:
    """A prediction's parts: the best branch's interval, and the envelope added by each kind."""

    lr_star: float
    param: tuple[float, float]
    by_kind: dict[str, tuple[float, float]]
    interval: tuple[float, float]
    conditional: dict[str, float]  # the best branch's interval ratio if that term were known exactly
    extrapolated: list[str]
    unmeasured: list[str]  # factors without a term whose value here the data never had

    @property
    def ratio(self) -> float:
        """The interval's width; infinite when a factor without a term is not at the data's value."""
        return math.inf if self.unmeasured else self.interval[1] / self.interval[0]


@dataclass
class HazardLaw:
    best: HazardFit
    box: dict[str, list[float]]
    criterion: str = ""
    alternatives: list[Branch] = field(default_factory=list)
    level: float = 0.95
    draws: int = DRAWS
    provenance: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None

    def _quantiles(self, fit: HazardFit, x: Mapping[str, float],
                   sched: Schedule) -> tuple[float, float, float]:
        d = draws(fit, self.draws, seed=0)
        v = log_lr_star(d, fit.form, x, sched)
        a = (1 - self.level) / 2
        return float(v[0]), float(np.quantile(v, a)), float(np.quantile(v, 1 - a))

    def spread(self, x: Mapping[str, float], sched: Schedule) -> Spread:
        mid, lo, hi = self._quantiles(self.best, x, sched)
        by_kind: dict[str, tuple[float, float]] = {}
        env_lo, env_hi = lo, hi
        for b in self.alternatives:
            if b.kind == "influence":  # a refit without one configuration: its estimate (its own
                bmid = float(log_lr_star(b.fit.theta, b.fit.form, x, sched)[0])  # interval is the data lost)
                blo = bhi = bmid
            else:
                _, blo, bhi = self._quantiles(b.fit, x, sched)
            klo, khi = by_kind.get(b.kind, (math.inf, -math.inf))
            by_kind[b.kind] = (min(klo, blo), max(khi, bhi))
            env_lo, env_hi = min(env_lo, blo), max(env_hi, bhi)
        cond = {}
        cols = self.best.form.columns()
        for i, c in enumerate(cols):
            if c in ("const", "log lr"):
                continue
            keep = [j for j in range(len(cols)) if j != i]
            cov = self.best.cov
            sub = cov[np.ix_(keep, keep)] - np.outer(cov[keep, i], cov[i, keep]) / cov[i, i]
            known = HazardFit(self.best.form, self.best.theta, np.zeros_like(cov), 0.0, 0, 0)
            known.cov[np.ix_(keep, keep)] = sub
            _, clo, chi = self._quantiles(known, x, sched)
            cond[c] = math.exp(chi - clo)
        ext = [f"{f} {x[f]:,.0f} {'<' if x[f] < a else '>'} {a if x[f] < a else b:,.0f}"
               for f, (a, b) in self.box.items() if not a <= x[f] <= b]
        unmeasured = [f"{f} (measured {_span(a, b)}; here {x[f]:,.0f})" for f, (a, b) in self.box.items()
                      if f not in self.best.form.factors and not a <= x[f] <= b]
        return Spread(math.exp(mid), (math.exp(lo), math.exp(hi)),
                      {k: (math.exp(a), math.exp(b)) for k, (a, b) in by_kind.items()},
                      (math.exp(env_lo), math.exp(env_hi)), cond, ext, unmeasured)

    def p_collapse(self, x: Mapping[str, float], sched: Schedule) -> tuple[float, float, float]:
        """P(collapse by the last step) at the schedule's peak lr: estimate and the best branch's interval."""
        d = draws(self.best, self.draws, seed=0)
        p = p_collapse(d, self.best.form, x, sched)
        a = (1 - self.level) / 2
        return float(p[0]), float(np.quantile(p, a)), float(np.quantile(p, 1 - a))

    def as_dict(self) -> dict[str, Any]:
        d = {"schema": SCHEMA, "version": VERSION, "criterion": self.criterion, "best": self.best.as_dict(),
             "alternatives": [a.as_dict() for a in self.alternatives], "box": self.box, "level": self.level,
             "draws": self.draws, "provenance": self.provenance}
        return with_validation(d, self.validation)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HazardLaw:
        box = read_box(d, SCHEMA, VERSION)
        if sorted(box) != sorted(FACTORS):
            raise ValueError(f"box has {sorted(box)}, expected {sorted(FACTORS)}")
        alts = [Branch(a["kind"], a["name"], HazardFit.from_dict(a["fit"])) for a in d["alternatives"]]
        return cls(HazardFit.from_dict(d["best"]), box, d.get("criterion", ""), alts, float(d["level"]),
                   int(d["draws"]), dict(d.get("provenance", {})), d.get("validation"))


def _span(a: float, b: float) -> str:
    return f"{a:,.0f}" if a == b else f"{a:,.0f}-{b:,.0f}"


def save(path: str | os.PathLike[str], law: HazardLaw) -> None:
    atomic_write_text(Path(path), json.dumps(law.as_dict(), indent=1) + "\n")


def load(path: str | os.PathLike[str] | None = None) -> HazardLaw:
    """The law at ``path`` (default: the shipped fit); ValueError naming the file when it is not one."""
    chosen = Path(path) if path else SHIPPED
    try:
        return HazardLaw.from_dict(json.loads(chosen.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{chosen}: not a hazard-law fit ({type(e).__name__}: {e}); refit with make law"
                         ) from None


def risk_line(law: HazardLaw, x: Mapping[str, float], sched: Schedule) -> dict[str, Any]:
    """The planner's delayed-collapse record and line for a run (factors ``x``, schedule ``sched``)."""
    s = law.spread(x, sched)
    lo, hi = s.interval
    head = (f"delayed collapse (hazard law): lr* {s.lr_star:.3g} [{lo:.3g}, {hi:.3g}] (x{hi / lo:.3g}"
            + (" over the terms it has" if s.unmeasured else "")
            + f"; P = 1/2 of collapsing by step {sched.train_iters:,} on this schedule)")
    rec: dict[str, Any] = {"lr_star": s.lr_star, "interval": [lo, hi],
                           "ratio": None if s.unmeasured else s.ratio,  # None: unbounded (strict JSON)
                           "unmeasured": s.unmeasured,
                           "param_interval": list(s.param),
                           "by_kind": {k: list(v) for k, v in s.by_kind.items()},
                           "conditional": s.conditional, "extrapolated": s.extrapolated}
    if s.unmeasured:
        head += ("; no P(collapse): no term for " + ", ".join(s.unmeasured) + ": the data hold no delayed "
                 "collapse there, so the law cannot see past it")
        rec["p_collapse"] = None
    elif s.ratio > UNINFORMATIVE:
        worst = max(s.conditional, key=lambda c: -s.conditional[c], default=None)
        kinds = max(s.by_kind, key=lambda k: s.by_kind[k][1] / s.by_kind[k][0], default=None)
        why = []
        if worst is not None:
            why.append(f"the {worst} term (known exactly, the parameter interval would be "
                       f"x{s.conditional[worst]:.3g} instead of x{s.param[1] / s.param[0]:.3g})")
        if kinds is not None:
            why.append(f"the {kinds} alternatives ([{s.by_kind[kinds][0]:.3g}, {s.by_kind[kinds][1]:.3g}])")
        head += f"; no P(collapse): wider than x{UNINFORMATIVE:g}; it cannot see past " + " and ".join(why)
        rec["p_collapse"] = None
    else:
        p, plo, phi = law.p_collapse(x, sched)
        head += f"; P(collapse) at lr {sched.lr:.3g}: {p:.2f} [{plo:.2f}, {phi:.2f}]"
        rec["p_collapse"], rec["p_interval"] = p, [plo, phi]
    if s.extrapolated:
        head += "; outside the measured box: " + ", ".join(s.extrapolated)
    rec["line"] = head
    return rec
