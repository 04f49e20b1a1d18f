"""megapost/study (issue 40): the three outcomes with their step on hand-built series and rows, the hazard
fit on event times drawn from a known hazard, lr* against a step-by-step sum, the planner's line (no
P(collapse) past x10), the sweep's refusal of a pass-through --lr-decay-style, and the package torch-free."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megapost.study.events import DELAYED, FAILED, SURVIVED, Criterion, from_row, from_series
from megapost.study.hazard import HazardFit, HazardRun, HForm, Schedule, fit, log_lr_star
from megapost.study.law import HazardLaw, risk_line

REPO = Path(__file__).resolve().parents[1]
L = 6.5


def _series(n: int, learned_at: int | None, pinned_from: int | None, live_ratio: bool = False):
    """Steps 5, 10, ... 5n: loss at L until ``learned_at``, then L - 1; from ``pinned_from`` on the loss
    back at L, t_sim 0.99 and the gradient ratio 1e-4 (1.0 with ``live_ratio``)."""
    steps = [5 * (i + 1) for i in range(n)]
    loss, tsim, ratio = [], [], []
    for s in steps:
        pinned = pinned_from is not None and s >= pinned_from
        learned = learned_at is not None and s >= learned_at and not pinned
        loss.append(L - 1.0 if learned else L)
        tsim.append(0.99 if pinned else 0.2)
        ratio.append(1.0 if live_ratio or not pinned else 1e-4)
    return steps, loss, tsim, ratio


def test_the_three_outcomes_and_their_steps_from_a_series() -> None:
    failed = from_series(*_series(100, None, None), L)
    assert (failed.kind, failed.step, failed.at_risk_until) == (FAILED, None, 500)
    delayed = from_series(*_series(100, 50, 300), L)
    assert (delayed.kind, delayed.step, delayed.at_risk_until) == (DELAYED, 300, 300)
    # the trailing 5-point mean first reaches L - 0.3 at the drop's second point (2 x (L-1), 3 x L: L - 0.4)
    assert delayed.learned_step == 55
    late = from_series(*_series(100, 50, 450), L)  # pinned only for the last 50 steps: not confirmed
    assert (late.kind, late.step, late.at_risk_until) == (SURVIVED, None, 400)
    live = from_series(*_series(100, 50, 300, live_ratio=True), L)  # gradients still flow: not collapsed
    assert live.kind == SURVIVED
    short = from_series(*_series(100, 50, 300), L, Criterion(sustain=250))
    assert short.kind == SURVIVED and short.at_risk_until == 250


def test_the_outcome_of_a_results_row() -> None:
    row = {"train_iters": "630", "best_gap": "-0.9", "final_gap": "0.02", "final_tsim": "0.99",
           "final_grad_ratio": "1e-4", "transition_step": "364"}
    assert from_row(row).kind == DELAYED and from_row(row).step == 364
    assert from_row({**row, "transition_step": "600"}).kind == SURVIVED  # 30 steps pinned < K = 100
    assert from_row({**row, "final_grad_ratio": "0.5"}).kind == SURVIVED
    assert from_row({**row, "best_gap": "-0.2"}).kind == FAILED
    assert from_row({**row, "best_gap": "-0.4"}, Criterion(learned_gap=0.5)).kind == FAILED


TRUE = {"b0": 24.9, "beta": 8.0, "depth": 2.0}


def _simulated_runs(seed: int) -> list[HazardRun]:
    """Per step a Bernoulli(1 - exp(-lambda(t))) draw with lambda = exp(b0 + beta log lr(t) + 2 log(depth/4))
    (numpy's generator, step by step: not the fitter's interval grouping)."""
    rng = np.random.default_rng(seed)
    runs = []
    for depth in (4.0, 8.0):
        for lr in (0.012, 0.016, 0.02, 0.025, 0.03):
            sched = Schedule(lr, lr, 50, 600, "constant")
            lam = [math.exp(TRUE["b0"] + TRUE["beta"] * math.log(sched.at([t])[0])
                            + TRUE["depth"] * math.log(depth / 4)) for t in range(600)]
            for k in range(40):
                hit = next((t for t in range(600) if rng.random() < -math.expm1(-lam[t])), None)
                ev = (DELAYED, hit, 0, hit + 1) if hit is not None else (SURVIVED, None, 0, 600)
                from megapost.study.events import Event
                runs.append(HazardRun(f"d{depth}", {"width": 64.0, "depth": depth, "warmup": 50.0,
                                                    "tokens_per_step": 256.0}, sched, Event(*ev), 0, k))
    return runs


def test_the_hazard_fit_recovers_a_known_hazard_and_its_lr_star() -> None:
    runs = _simulated_runs(0)
    got = fit(runs, HForm(("depth",), "none"))
    sd = np.sqrt(np.diag(got.cov))
    b0 = TRUE["b0"] + TRUE["beta"] * 0.0  # REF depth 4: the design's depth entry is log(depth / 4)
    for value, truth, s in zip(got.theta, (b0, TRUE["beta"], TRUE["depth"]), sd, strict=True):
        assert abs(value - truth) < 3.5 * s, (got.theta, sd)
    assert sd[1] < 1.0  # 400 runs pin the lr slope
    # lr* at depth 8 on the simulated schedule: the lr at which sum_t lambda(t) = ln 2, by bisection on the
    # true hazard summed step by step; the fitted lr* within its own delta-method band
    x = {"width": 64.0, "depth": 8.0, "warmup": 50.0, "tokens_per_step": 256.0}

    def cum(lr: float) -> float:
        s = Schedule(lr, lr, 50, 600, "constant")
        return sum(math.exp(TRUE["b0"] + TRUE["beta"] * math.log(s.at([t])[0]) + TRUE["depth"] * math.log(2))
                   for t in range(600))

    lo, hi = 1e-3, 1e-1
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if cum(mid) < math.log(2) else (lo, mid)
    sched = Schedule(0.02, 0.02, 50, 600, "constant")
    exact_at_truth = log_lr_star(np.array([[b0, TRUE["beta"], TRUE["depth"]]]), got.form, x, sched)[0]
    assert exact_at_truth == pytest.approx(math.log(lo), abs=0.01)  # the interval grouping costs < 1 %
    fitted = log_lr_star(got.theta, got.form, x, sched)[0]
    assert abs(fitted - math.log(lo)) < 0.15


def _law(scale: float) -> HazardLaw:
    form = HForm((), "none")
    best = HazardFit(form, np.array([24.9, 8.0]), np.diag([scale, scale / 400]), -1.0, 10, 100)
    box = {"width": [64, 64], "depth": [4, 4], "warmup": [500, 500], "tokens_per_step": [256, 256]}
    return HazardLaw(best, box)


def test_the_planner_line_prints_p_only_when_the_interval_is_narrow() -> None:
    x = {"width": 64.0, "depth": 4.0, "warmup": 500.0, "tokens_per_step": 256.0}
    sched = Schedule(0.02, 0.02, 500, 2500, "constant")
    narrow = risk_line(_law(1e-6), x, sched)
    assert narrow["ratio"] < 1.1 and narrow["p_collapse"] is not None
    assert "P(collapse) at lr 0.02" in narrow["line"]
    # P by hand: 1 - exp(-sum_t exp(b0 + beta log lr(t))) over the 5-step intervals' middle steps
    mids = [(s + min(s + 5, 2500) - 1) // 2 for s in range(0, 2500, 5)]
    h = sum(5 * math.exp(24.9 + 8.0 * math.log(sched.at([m])[0])) for m in mids)
    assert narrow["p_collapse"] == pytest.approx(-math.expm1(-h), rel=1e-6)
    wide = risk_line(_law(100.0), x, sched)
    assert wide["ratio"] > 10 and wide["p_collapse"] is None
    assert "no P(collapse): wider than x10" in wide["line"]
    unseen = risk_line(_law(1e-6), {**x, "depth": 48.0}, sched)  # no depth term, depth never varied
    assert unseen["p_collapse"] is None and unseen["ratio"] is None
    assert "no term for depth (measured 4; here 48)" in unseen["line"]
    assert "outside the measured box: depth 48 > 4" in unseen["line"]


def test_the_sweep_refuses_a_pass_through_decay_style() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    from sweep_results import check_extra

    check_extra(["--collapse-guard", "--z-loss", "1e-4"])
    with pytest.raises(SystemExit, match="--lr-decay-style after '--'.*use the sweep's --decay-style"):
        check_extra(["--lr-decay-style", "constant"])
    with pytest.raises(SystemExit, match="--train-iters after '--'"):
        check_extra(["--train-iters=5"])


def test_the_study_package_is_torch_free() -> None:
    code = ("import sys; import megapost.study.__main__, megapost.study.fit, megapost.study.boundary_fit; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_the_paper_setting_is_the_presets() -> None:
    from megapost.config.presets import PRESETS
    from megapost.study.report import PAPER_MIN_LR, PAPER_TRAIN_ITERS, PAPER_X

    p = PRESETS["paper-180m"]
    assert PAPER_X == {"width": p["hidden_size"], "depth": p["num_layers"], "warmup": p["lr_warmup_iters"],
                       "tokens_per_step": p["global_batch_size"] * p["seq_length"]}
    assert (PAPER_TRAIN_ITERS, PAPER_MIN_LR, p["lr_decay_style"]) == (p["train_iters"], p["min_lr"], "cosine")


def test_the_planner_reads_its_hazard_law_and_names_a_bad_file(tmp_path) -> None:
    from argparse import Namespace

    from megapost.plan.collapse_risk import delayed_collapse_risk
    from megapost.study.law import save

    flags = Namespace(norm_position="post", lr=0.02, min_lr=0.002, lr_warmup_iters=500, train_iters=2500,
                      lr_decay_style="cosine", global_batch_size=8, seq_length=32)
    model = Namespace(hidden_size=64, num_layers=4)
    save(tmp_path / "law.json", _law(1e-6))
    got = delayed_collapse_risk(flags, model, str(tmp_path / "law.json"))
    sched = Schedule(0.02, 0.002, 500, 2500, "cosine")
    x = {"width": 64.0, "depth": 4.0, "warmup": 500.0, "tokens_per_step": 256.0}
    assert got["line"] == risk_line(_law(1e-6), x, sched)["line"] and got["available"]
    (tmp_path / "bad.json").write_text('{"schema": "megapost.collapse_law", "version": 1}')
    with pytest.raises(SystemExit, match="--hazard-law .*bad.json: not a hazard-law fit"):
        delayed_collapse_risk(flags, model, str(tmp_path / "bad.json"))
    assert "Post-Norm only" in delayed_collapse_risk(Namespace(**{**vars(flags), "norm_position": "pre"}),
                                                     model)["line"]


def test_the_shipped_hazard_law_is_the_fit_of_the_shipped_data() -> None:
    """megapost/study/hazard_law_post.json is what `make law` writes from study/results (a rerun of
    the best form's fit reproduces its coefficients)."""
    from megapost.study.fit import fit_law
    from megapost.study.law import load
    from megapost.study.results import read_rows

    shipped = load()
    refit = fit_law(read_rows(REPO / "study" / "results"), influence=False)
    assert refit.best.form == shipped.best.form
    assert refit.best.theta == pytest.approx(shipped.best.theta, rel=1e-9, abs=1e-12)
    assert refit.best.events == shipped.best.events and refit.best.runs == shipped.best.runs


def test_the_readme_quotes_the_shipped_hazard_laws_paper_lr_star() -> None:
    """README's sentence 'puts paper-180m's lr* at A [B, C]' is the shipped law's spread at the paper's
    setting, at the README's 2 significant digits (a refit that moves it fails here until re-quoted)."""
    from megapost.study.law import load
    from megapost.study.report import PAPER_X, paper_schedule

    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    got = re.search(r"puts paper-180m's lr\* at (\S+) \[(\S+), (\S+)\]", text)
    assert got, "README no longer quotes the delayed-collapse law's paper-180m lr*"
    s = load().spread(PAPER_X, paper_schedule(8e-4))
    for quoted, value in zip(got.groups(), (s.lr_star, *s.interval), strict=True):
        assert float(quoted.rstrip(";,.")) == pytest.approx(float(f"{value:.2g}")), (quoted, value)
