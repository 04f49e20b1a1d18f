"""Outcomes as probabilities (collapse_metrics/analysis/probabilities.py): Wilson intervals against an
independent solution of the score equation, per-cell aggregation, warning calibration; the stability
sweep's resumability (a second invocation starts no run) and its probability files; the boundary's
bisection and power-law fit (megapost/study/bisection.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from collapse_metrics.analysis.probabilities import (
    aggregate,
    calibrate,
    first_above_min,
    first_growth,
    first_rise,
    wilson,
)
from launch_utils import REPO
from scipy.stats import norm

from megapost.study.bisection import Bracket, fit_power_law, predict


def _wilson_by_roots(k: int, n: int) -> tuple[float, float]:
    """The Wilson bounds are the p with (k/n - p)^2 = z^2 p (1 - p) / n: the roots of a quadratic."""
    z, ph = norm.ppf(0.975), k / n
    roots = np.roots([1 + z * z / n, -(2 * ph + z * z / n), ph * ph])
    lo, hi = sorted(float(r.real) for r in roots)
    return max(0.0, lo), min(1.0, hi)


@pytest.mark.parametrize(("k", "n"), [(0, 8), (1, 8), (3, 8), (4, 8), (8, 8), (5, 10), (37, 100)])
def test_wilson_matches_the_score_equation(k, n):
    assert wilson(k, n) == pytest.approx(_wilson_by_roots(k, n), abs=1e-12)


def test_wilson_known_values_and_empty():
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # textbook value
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def _run(seed, outcome, delayed=False, step=None, gap=0.0, **cell):
    return {"variant": "post", "depth": 4, "lr": 0.03, "warmup": 200, **cell, "seed": seed,
            "outcome": outcome, "delayed": delayed, "transition_step": step, "final_gap": gap}


def test_aggregate_counts_probabilities_and_spread():
    runs = [_run(1, "collapsed", True, 300, 0.04), _run(2, "collapsed", False, 120, 0.0),
            _run(3, "plateau", gap=-0.1), _run(4, "trained", gap=-0.4), _run(5, "plateau", gap=-0.2),
            _run(1, "trained", gap=-1.0, variant="pre")]
    post, pre = aggregate(runs, ("variant", "depth", "lr", "warmup"))
    assert post["n"] == 5 and post["seeds"] == [1, 2, 3, 4, 5]
    assert (post["collapsed"]["k"], post["delayed"]["k"], post["plateau"]["k"], post["trained"]["k"]) == \
        (2, 1, 2, 1)
    assert post["collapsed"]["p"] == 0.4
    assert (post["collapsed"]["lo"], post["collapsed"]["hi"]) == wilson(2, 5)
    assert post["transition_steps"] == [120, 300] and post["transition_median"] == 210
    gaps = [0.04, 0.0, -0.1, -0.4, -0.2]
    assert post["final_gap_mean"] == pytest.approx(np.mean(gaps))
    assert post["final_gap_std"] == pytest.approx(np.std(gaps, ddof=1))
    assert (post["final_gap_min"], post["final_gap_max"]) == (-0.4, 0.04)
    assert pre["n"] == 1 and pre["trained"]["p"] == 1.0


def test_warning_rules_and_calibration():
    series = [(4, 8.0), (8, 6.0), (12, 20.0), (16, 25.0)]
    assert first_growth(series, 3.0) == 12 and first_growth(series, 5.0) is None
    assert first_rise([(4, 1.0), (8, 0.3), (12, 0.6)], 0.5, 0.35) == 12
    assert first_rise([(4, 1.0), (8, 0.6)], 0.5, 0.35) is None  # never fell: the start is no re-rise
    assert first_above_min([(s, v) for s, v in zip(range(1, 9), [7, 6, 5, 5, 5, 6, 7, 8], strict=True)],
                           0.5, window=1) == 6
    runs = [{"outcome": "collapsed", "transition_step": 100, "w": 60},
            {"outcome": "collapsed", "transition_step": 100, "w": 120},  # too late: not a hit
            {"outcome": "plateau", "transition_step": None, "w": 50},  # false alarm
            {"outcome": "trained", "transition_step": None, "w": None}]
    best, never = calibrate(runs, {"w": lambda r: r["w"], "never": lambda r: None})
    assert best["rule"] == "w" and best["hits"] == 1 and best["warned"] == 3 and best["lead_steps"] == [40]
    assert best["precision"]["p"] == pytest.approx(1 / 3) and best["recall"]["p"] == 0.5
    assert (best["recall"]["lo"], best["recall"]["hi"]) == wilson(1, 2)
    assert never["warned"] == 0 and math.isnan(never["precision"]["p"]) and never["f1"] == 0.0


def _fake_cell(root, name: str, collapsed: bool) -> None:
    """A finished cell: outcome.json plus a small JSONL (the calibration replays it)."""
    cell = root / "cells" / name
    (cell / "tensorboard").mkdir(parents=True)
    lines = []
    for step in range(4, 41, 4):
        late = collapsed and step >= 24
        lines += [{"step": step, "layer": 1, "sublayer": "ffn", "t_sim_out": 0.1, "resid_norm": 8.0,
                   "grad_norm_layer": 1e-9 if late else 1.0},
                  {"step": step, "layer": 2, "sublayer": "ffn", "t_sim_out": 0.1,
                   "resid_norm": 8.0 * (3.0 if collapsed and step >= 16 else 1.0), "grad_norm_layer": 1.0},
                  {"step": step, "loss": 7.0 if late else 5.0, "t_sim_head": 1.0 if late else 0.2}]
    (cell / "tensorboard" / "collapse_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (cell / "outcome.json").write_text(json.dumps(
        {"outcome": "collapsed" if collapsed else "trained", "transition_step": 24 if collapsed else None,
         "delayed": False, "best_gap": -1.0, "final_gap": 0.0 if collapsed else -2.0, "final_tsim": 0.5,
         "final_grad_ratio": 1.0, "alarm_step": None, "alarm_final": False, "warning_step": None,
         "seconds": 30.0}))


def test_sweep_resumes_without_running_and_writes_probabilities(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import stability_sweep

    out = tmp_path / "sweep"
    for seed in (1, 2, 3):
        _fake_cell(out, f"post_L2_lr0.1_w0_s{seed}", collapsed=seed != 3)

    def no_run(*a, **k):
        raise AssertionError("a finished cell was run again")

    monkeypatch.setattr(stability_sweep, "train", no_run)  # the one place a cell is trained
    argv = ["--out", str(out), "--data-path", tiny_data.prefix, "--tokenizer-model",
            tiny_data.tokenizer_model, "--depths", "2", "--lrs", "0.1", "--warmups", "0", "--variants",
            "post", "--seeds", "1,2,3", "--jobs", "2"]
    for _ in range(2):
        assert stability_sweep.main(argv) == 0
    log = capsys.readouterr().out
    assert "[sweep] progress 3/3 cells (0 run now" in log
    cells = json.loads((out / "cells.json").read_text())
    assert len(cells) == 1 and cells[0]["collapsed"]["k"] == 2 and cells[0]["trained"]["k"] == 1
    assert "| post | 2 | 0.1 | 0 | 3 | 0.67 [0.21, 0.94] (2/3) |" in (out / "cells.md").read_text()
    assert (out / "prob_L2.png").read_bytes()[:4] == b"\x89PNG"
    rules = {r["rule"]: r for r in json.loads((out / "warning.json").read_text())}
    assert rules["resid x2"]["hits"] == 2 and rules["resid x2"]["lead_steps"] == [8, 8]
    assert rules["resid x4"]["warned"] == 0


def test_bisection_brackets_the_threshold_and_the_fit_recovers_the_law():
    """Noise-free outcomes (a step at the threshold): the bookkeeping of the bisection and the algebra of
    the midpoint fit (exact data, exact exponents). The statistics are the next test's."""
    points = []
    for w in (32, 64, 128):
        for d in (2, 4, 8):
            true = 0.5 * w ** -0.5 * d ** -1.0
            b = Bracket(w, d, 1e-4, 1.0, steps=12)
            for _ in range(12):
                for lr in b.next_lrs():
                    b.record(lr, int(lr >= true), 1)
            assert b.status == "open" and b.lo <= true * 1.001 and b.hi >= true * 0.999 and b.hi / b.lo < 1.02
            points.append(b)
    fit = fit_power_law(points)
    assert fit["b_width"] == pytest.approx(-0.5, abs=0.02) and fit["c_depth"] == pytest.approx(-1.0, abs=0.02)
    pred = predict(fit, 2048, 24)
    assert pred["lr_star"] == pytest.approx(0.5 * 2048 ** -0.5 / 24, rel=0.1) and not pred["inside"]
    assert pred["interval"][0] < pred["lr_star"] < pred["interval"][1]
    below = Bracket(32, 2, 1e-3, 1e-2, lr_min=1e-3)
    below.record(1e-3, 2, 2)
    assert below.status == "below" and below.next_lrs() == []


def test_bisection_under_seed_noise_recovers_the_exponents_within_their_standard_error():
    """Outcomes drawn as the study sees them: each probe runs 8 seeds, each collapses with probability
    Phi(log(lr / lr*) / 0.25) (scipy), lr* = 0.5 w^-0.5 d^-1. The fitted exponents must lie within 4
    standard errors of the truth, the error of an ordinary least-squares slope computed here from the
    brackets' own scatter around lr* (independent of fit_power_law). The fit's interval is the spread of
    the bracket widths only, not of the seed noise: it is not asserted to cover the truth."""
    rng, sigma, seeds = np.random.default_rng(0), 0.25, 8
    widths, depths = (16, 32, 64, 128, 256), (2, 4, 8, 16)
    points, errors = [], []
    for w in widths:
        for d in depths:
            true = 0.5 * w ** -0.5 * d ** -1.0
            b = Bracket(w, d, 1e-4, 1.0, steps=8)
            for _ in range(14):
                for lr in b.next_lrs():
                    b.record(lr, int(rng.binomial(seeds, norm.cdf(math.log(lr / true) / sigma))), seeds)
            assert b.status == "open" and abs(math.log(b.estimate / true)) < 4 * sigma
            points.append(b)
            errors.append(math.log(b.estimate / true))
    fit = fit_power_law(points)
    spread = float(np.std(errors, ddof=3))  # residual scale of log lr* about the law (3 coefficients)
    sxx = lambda axis: len(points) / len(axis) * float(np.sum((np.log(axis) - np.log(axis).mean()) ** 2))
    se = {"b_width": spread / math.sqrt(sxx(widths)), "c_depth": spread / math.sqrt(sxx(depths))}  # OLS
    assert 0.005 < se["b_width"] < 0.1, se  # the outcomes were noisy, and not so noisy that anything fits
    for key, truth in (("b_width", -0.5), ("c_depth", -1.0)):
        assert abs(fit[key] - truth) <= 4 * se[key], (key, fit[key], se)


@pytest.mark.parametrize("true", [4e-4, 4e-5, 0.35])
def test_a_bracket_on_the_wrong_side_widens_until_it_holds(true):
    """Both ends collapse (or neither): the bracket moves out by the factor, keeps every probe, then
    bisects the widened decade; the threshold ends inside a bracket of 10^(1/8) after 3 steps."""
    b = Bracket(64, 4, 3e-3, 1e-1, steps=3, widen=10.0, lr_min=1e-5, lr_max=1.0)
    rounds = 0
    while b.next_lrs():
        for lr in b.next_lrs():
            b.record(lr, 3 * int(lr >= true), 3)
        rounds += 1
    assert b.status == "open" and b.lo < true <= b.hi and b.bisected == 3
    assert b.hi / b.lo == pytest.approx(10 ** (1 / 8), rel=0.01)
    lrs = [p["lr"] for p in b.probes]
    assert lrs[:2] == [3e-3, 0.1] and len(lrs) == len(set(lrs)) == rounds + 1
    assert all(bool(p["k"]) == (p["lr"] >= true) for p in b.probes)
    past = Bracket(64, 4, 3e-3, 1e-1, widen=10.0, lr_min=1e-4)
    for _ in range(4):
        for lr in past.next_lrs():
            past.record(lr, 3, 3)
    assert past.status == "below" and [p["lr"] for p in past.probes] == [3e-3, 0.1, 3e-4]


def test_the_verify_runs_are_trainer_commands_on_the_fits_data(monkeypatch):
    """tools/collapse_boundary.py's GPU verification runs: lr*/2, lr*, 2 lr* x seeds at the next preset,
    each one a command the trainer's own parser accepts, on the data and tokenizer the fit was made on."""
    import shlex

    from collapse_metrics.plugin import CollapseMetricsPlugin

    from megapost.config.arguments import build_parser

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import collapse_boundary

    args = collapse_boundary.build_parser().parse_args(
        ["--out", "x", "--data-path", "d/news2k_text_document", "--tokenizer-model", "d/bpe2k.model",
         "--seeds", "1,2"])
    fit = {"log_a": math.log(0.5), "b_width": -0.5, "c_depth": -1.0, "samples": [[math.log(0.5), -0.5, -1.0]],
           "range": {"widths": [32, 128], "depths": [2, 8]}}
    rows = collapse_boundary.preset_rows(fit, ["llama-350m", "llama-7b"])
    lines = collapse_boundary.verify_runs(args, fit, rows)
    runs = [x for x in lines if not x.startswith("#")]
    assert len(runs) == 6 and "9 runs" not in lines[-1] and lines[-1].startswith("# 6 runs at llama-350m")
    star = 0.5 * 1024 ** -0.5 / 24
    parser = build_parser([CollapseMetricsPlugin])
    lrs = []
    for cmd in runs:
        argv = shlex.split(cmd.split("  #")[0])
        assert argv[:3] == ["python", "-m", "megapost.pretrain"]
        ns = parser.parse_args(argv[3:])
        assert ns.data_path == ["d/news2k_text_document"]
        assert ns.tokenizer_model == "d/bpe2k.model" and ns.lr_warmup_iters == 20 and ns.train_iters == 150
        lrs.append(ns.lr)
    assert sorted(set(lrs)) == pytest.approx([star / 2, star, 2 * star], rel=2e-3)
