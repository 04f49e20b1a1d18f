"""The hazard law's saturating tokens-per-step forms (issue 40): event times drawn step by step from a
known hazard whose batch effect saturates past a critical batch (or does not), at three batch sizes; the
fitter's AIC must pick the saturating form near the true critical batch, keep the plain power law when
that is the truth, and find the gradient-noise limit (1 - 256 / B) when that is."""

from __future__ import annotations

import math

import numpy as np

from megapost.study.events import DELAYED, SURVIVED, Event
from megapost.study.fit import candidate_forms, varying
from megapost.study.hazard import INVERSE, HazardRun, Schedule, fit

B0, BETA, C = 24.9, 8.0, -8.0
STEPS = 500


def _effective(tokens: float, sat: float) -> float:
    if sat == INVERSE:  # the hazard in the gradient noise: log Beff = 1 - 256 / B
        return math.exp(1.0 - 256.0 / tokens)
    return tokens / (1.0 + tokens / sat) if sat else tokens


def _runs(sat: float, seed: int) -> list[HazardRun]:
    """lambda(t) = exp(B0 + BETA log lr + C log(Beff / Beff(256))), Beff = B / (1 + B / sat); each run's
    lrs scaled so that every batch size sees events (numpy's generator, one draw per step)."""
    rng = np.random.default_rng(seed)
    runs = []
    for tokens in (256.0, 1024.0, 4096.0):
        shift = -C / BETA * math.log(_effective(tokens, sat) / _effective(256.0, sat))
        for base in (0.012, 0.016, 0.02, 0.025):
            lr = base * math.exp(shift)
            sched = Schedule(lr, lr, 0, STEPS, "constant")
            eta = B0 + BETA * math.log(lr) + C * math.log(_effective(tokens, sat) / _effective(256.0, sat))
            p = -math.expm1(-math.exp(eta))
            for k in range(30):
                draws = rng.random(STEPS)
                hit = next((t for t in range(STEPS) if draws[t] < p), None)
                ev = Event(DELAYED, hit, 0, hit + 1) if hit is not None else Event(SURVIVED, None, 0, STEPS)
                runs.append(HazardRun(f"t{tokens:.0f}", {"width": 64.0, "depth": 4.0, "warmup": 0.0,
                                                          "tokens_per_step": tokens}, sched, ev, 0, k))
    return runs


def _ranked(runs: list[HazardRun]):
    assert varying(runs) == ("tokens_per_step",)
    forms = [f for f in candidate_forms(runs) if f.time == "none" and f.factors]
    return sorted((fit(runs, f) for f in forms), key=lambda f: f.aic)


def test_a_saturating_batch_effect_is_found_near_its_critical_batch() -> None:
    ranked = _ranked(_runs(sat=1024.0, seed=1))
    best = ranked[0]
    assert best.form.sat in (512.0, 1024.0, 2048.0), [(f.form.name, round(f.aic, 1)) for f in ranked]
    plain = next(f for f in ranked if not f.form.sat)
    assert plain.aic - best.aic > 2.0  # the power law is not a form alternative of the interval


def test_a_power_law_batch_effect_is_kept_as_one() -> None:
    ranked = _ranked(_runs(sat=0.0, seed=2))
    plain = next(f for f in ranked if not f.form.sat)
    assert plain.aic - ranked[0].aic <= 2.0, [(f.form.name, round(f.aic, 1)) for f in ranked]
    small = [f for f in ranked if f.form.sat and f.form.sat <= 1024.0]
    assert all(f.aic - plain.aic > 2.0 for f in small)  # saturation at <= 1,024 is ruled out


def test_a_hazard_in_the_gradient_noise_is_found_as_one() -> None:
    ranked = _ranked(_runs(sat=INVERSE, seed=3))
    assert ranked[0].form.sat in (INVERSE, 128.0), [(f.form.name, round(f.aic, 1)) for f in ranked]
    inverse = next(f for f in ranked if f.form.sat == INVERSE)
    assert inverse.aic - ranked[0].aic <= 2.0
    plain = next(f for f in ranked if not f.form.sat)
    assert plain.aic - inverse.aic > 2.0  # the power law in B is not within the interval's forms
