"""The one fitter of the delayed-collapse law: forms by AIC, the label / form / influence alternatives its
interval carries, and the leave-one-configuration-out coverage."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megapost.study.events import ALTERNATIVES, DEFAULT, DELAYED, Criterion
from megapost.study.hazard import (
    FACTORS,
    INVERSE,
    SAT_GRID,
    TIME_FORMS,
    HazardFit,
    HazardRun,
    HForm,
    draws,
    exposure,
    fit,
)
from megapost.study.law import Branch, HazardLaw
from megapost.study.results import Row, hazard_runs

FORM_DELTA_AIC = 2.0


def varying(runs: Sequence[HazardRun]) -> tuple[str, ...]:
    return tuple(f for f in FACTORS if len({r.x[f] for r in runs}) > 1)


def candidate_forms(runs: Sequence[HazardRun]) -> list[HForm]:
    """Every time-since-peak shape with every varying factor's term, each with one factor's term dropped,
    and, when tokens per step varies, each with the tokens term saturating at a critical batch of
    ``SAT_GRID``."""
    var = varying(runs)
    forms = [HForm(var, t) for t in TIME_FORMS]
    forms += [HForm(tuple(g for g in var if g != f), t) for f in var for t in TIME_FORMS]
    if "tokens_per_step" in var:
        forms += [HForm(var, t, sat) for t in TIME_FORMS for sat in (*SAT_GRID, INVERSE)]
    return forms


def _try(runs: Sequence[HazardRun], form: HForm) -> HazardFit | None:
    try:
        return fit(runs, form)
    except (ValueError, np.linalg.LinAlgError):
        return None


def fit_law(rows: Sequence[Row], crit: Criterion = DEFAULT, influence: bool = True) -> HazardLaw:
    runs, _ = hazard_runs(rows, crit)
    if not runs:
        raise ValueError("no run that learned in the data")
    fits = sorted((f for f in (_try(runs, form) for form in candidate_forms(runs)) if f is not None),
                  key=lambda f: f.aic)
    if not fits:
        raise ValueError("no hazard form could be fitted (no delayed collapse in the data?)")
    best = fits[0]
    alts = [Branch("form", f.form.name, f) for f in fits[1:] if f.aic - best.aic <= FORM_DELTA_AIC + 1e-6]
    for name, c in ALTERNATIVES.items():
        got = _try(hazard_runs(rows, c)[0], best.form)
        if got is not None:
            alts.append(Branch("label", name, got))
    with_short = hazard_runs(rows, crit, min_window=0)[0]
    got = _try(with_short, best.form) if len(with_short) > len(runs) else None
    if got is not None:
        alts.append(Branch("label", "with the short rows (at risk from step 0)", got))
    if influence:
        for config in sorted({r.config for r in runs}):
            kept = [r for r in runs if r.config != config]
            got = _try(kept, best.form) if set(varying(kept)) >= set(best.form.factors) else None
            if got is not None:
                alts.append(Branch("influence", f"without {config}", got))
    box = {f: [min(r.x[f] for r in runs), max(r.x[f] for r in runs)] for f in FACTORS}
    forms = [{"name": f.form.name, "loglik": f.loglik, "params": f.params, "aic": f.aic} for f in fits]
    return HazardLaw(best, box, crit.describe(), alts,
                     provenance={"runs": len(runs), "events": best.events, "forms": forms,
                                 "configs": len({r.config for r in runs})})


def run_probability(thetas: np.ndarray, form: HForm, run: HazardRun) -> np.ndarray:
    """P(the run collapses within its time at risk) per parameter row."""
    log_lr, tau, n, _ = exposure(run)
    if not len(n):
        return np.zeros(len(thetas))
    eta = thetas @ form.design(log_lr, tau, run.x).T + np.log(n)[None, :]
    return -np.expm1(-np.exp(eta).sum(axis=1))


def loo_coverage(runs: Sequence[HazardRun], form: HForm, count: int = 400,
                 seed: int = 0) -> list[dict[str, object]]:
    """Per configuration: refit without it, then the 95 % predictive band of its number of delayed
    collapses (parameter draws x Bernoulli per run) against the observed number."""
    rng = np.random.default_rng(seed)
    out = []
    for config in sorted({r.config for r in runs}):
        mine = [r for r in runs if r.config == config]
        kept = [r for r in runs if r.config != config]
        row: dict[str, object] = {"config": config, "runs": len(mine),
                                  "observed": sum(r.event.kind == DELAYED for r in mine)}
        fitted = _try(kept, form) if set(varying(kept)) >= set(form.factors) else None
        if fitted is None:
            row.update(expected=None, band=None, covered=None, note="not refittable without it")
            out.append(row)
            continue
        th = draws(fitted, count, seed)
        p = np.stack([run_probability(th, form, r) for r in mine], axis=1)
        sims = (rng.random(p.shape) < p).sum(axis=1)
        lo, hi = np.quantile(sims, 0.025), np.quantile(sims, 0.975)
        row.update(expected=float(p.mean(axis=0).sum()), band=[int(lo), int(hi)],
                   covered=bool(lo <= row["observed"] <= hi))
        out.append(row)
    return out
