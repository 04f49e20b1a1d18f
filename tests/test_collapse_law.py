"""The collapse law's fitter (megapost/study/boundary_fit.py) on outcomes drawn from a known law, its
schema (collapse_law.py) and megapost-law boundary end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2, norm

from megapost.config.errors import ConfigError
from megapost.study.boundary_fit import _erfc, chi2_sf, fit_law, make_probe, separable
from megapost.study.boundary_law import Form, Law, load_law, save_law

REPO = Path(__file__).resolve().parents[1]
BASE = {"width": 64, "depth": 4, "warmup": 20, "tokens_per_step": 256, "decay_iters": 130, "seq": 32,
        "vocab": 2048, "heads": 4, "init": 0}
TRUTH = {"const": math.log(0.7), "log width": -0.7, "log depth": -1.0, "warmup:log1p": 0.5}
FORM = Form(("width", "depth", "warmup"), "log1p", 30.0)


def true_mu(x: dict, warmup: str = "log1p") -> float:
    w = math.log1p(x["warmup"] / 30) if warmup == "log1p" else x["warmup"] / (x["warmup"] + 100)
    return TRUTH["const"] - 0.7 * math.log(x["width"]) - math.log(x["depth"]) + TRUTH["warmup:log1p"] * w * (
        1 if warmup == "log1p" else 3)


def synthetic(seed: int, sigma: float = 0.15, tau: float = 0.05, seeds: int = 3, warmup: str = "log1p"):
    """3 widths x 3 depths x 4 warmups, 5 probes each around the true lr*, k of 3 seeds collapsing by
    Phi((log lr - mu - tau e) / sigma): numpy's binomial, not the fitter's Phi."""
    rng = np.random.default_rng(seed)
    probes = []
    for w in (64, 128, 256):
        for d in (4, 8, 16):
            for wu in (0, 20, 200, 2000):
                x = {**BASE, "width": w, "depth": d, "warmup": wu}
                mu = true_mu(x, warmup)
                shift = rng.normal() * tau
                for f in np.linspace(-0.6, 0.6, 5):
                    p = norm.cdf(f / sigma - shift / sigma)
                    probes.append(make_probe(x, math.exp(mu + f), rng.binomial(seeds, p), seeds))
    return probes


def test_the_probit_fit_recovers_a_known_law_within_its_intervals():
    law = fit_law(synthetic(7), draws=40, form=FORM, alternatives=False)
    b = law.best
    assert b.form.columns() == list(TRUTH)
    for i, (col, true) in enumerate(TRUTH.items()):
        sd = math.sqrt(b.cov[i][i])
        assert abs(b.coef[i] - true) <= 1.96 * sd, (col, b.coef[i], true, sd)
        assert sd < 0.2
    assert 0.08 < law.sigma < 0.25
    assert law.fixed == {"tokens_per_step": 256, "decay_iters": 130, "seq": 32, "vocab": 2048, "heads": 4,
                         "init": 0}
    assert law.box["width"] == [64, 256] and law.box["warmup"] == [0, 2000]


def test_a_factor_measured_at_one_configuration_keeps_its_term_and_interval():
    """One-factor-at-a-time sweeps put each factor's other value at a single configuration; a bootstrap
    that resamples configurations loses such a factor in ~1/3 of its draws (with three of them, most
    draws: it failed). The seed bootstrap keeps them: each exponent is fitted, its interval covering the
    truth (vocab -0.3, seq -0.4, heads 0)."""
    rng = np.random.default_rng(3)
    probes = [p for p in synthetic(11) if p.factors["warmup"] == 20]
    truth = {"vocab": (8192, -0.3), "seq": (128, -0.4), "heads": (16, 0.0)}
    for f_name, (v, slope) in truth.items():
        x = {**BASE, f_name: v}
        mu = true_mu(x) + slope * math.log(v / BASE[f_name])
        for f in np.linspace(-0.6, 0.6, 5):
            probes.append(make_probe(x, math.exp(mu + f), rng.binomial(3, norm.cdf(f / 0.15)), 3))
    law = fit_law(probes, draws=60, form=Form(("width", "depth", *truth)), alternatives=False)
    cols = law.best.form.columns()
    for f_name, (_, slope) in truth.items():
        i = cols.index(f"log {f_name}")
        sd = math.sqrt(law.best.cov[i][i])
        assert abs(law.best.coef[i] - slope) <= 1.96 * sd and sd < 0.3, (f_name, law.best.coef[i], sd)


@pytest.mark.slow
def test_interval_coverage_over_twenty_synthetic_studies():
    """Nominal 95 % intervals of every coefficient cover the truth in >= 80 % of 20 synthetic studies
    (the seed bootstrap plus the scatter term tau^2 (Z'Z)^-1; measured in the closing note)."""
    hits = np.zeros(len(TRUTH))
    for r in range(20):
        b = fit_law(synthetic(100 + r), draws=60, seed=r, form=FORM, alternatives=False).best
        sd = np.sqrt(np.diag(b.cov))
        hits += np.abs(np.array(b.coef) - list(TRUTH.values())) <= 1.96 * sd
    assert (hits / 20 >= 0.8).all(), hits


def test_the_likelihood_picks_the_warmup_form_that_made_the_data():
    """Outcomes drawn with a saturating warmup gain warmup/(warmup + 100): AIC ranks a sat form first;
    drawn with log(1 + warmup/30): a log1p form first; and no warmup effect at all: the best form's
    warmup term (if any) has an interval that holds 0."""
    sat = fit_law(synthetic(3, warmup="sat"), draws=20)
    assert sat.best.form.warmup == "sat" and sat.best.form.w0 in (30.0, 100.0, 300.0)
    log1p = fit_law(synthetic(3), draws=20)
    assert log1p.best.form.warmup == "log1p" and log1p.best.form.w0 in (10.0, 30.0, 100.0)
    assert [f["aic"] for f in log1p.forms] == sorted(f["aic"] for f in log1p.forms)
    assert all(a.delta_aic <= 2.0 for a in log1p.alternatives)


def test_numerics_match_scipy():
    x = np.linspace(-6, 26, 2001)
    assert np.allclose(_erfc(x), [math.erfc(v) for v in x], rtol=2e-7, atol=0)
    for dof in (1, 2, 3, 4, 5):
        for stat in (0.1, 1.0, 3.84, 12.0):
            assert chi2_sf(stat, dof) == pytest.approx(chi2.sf(stat, dof), rel=1e-9)


def test_the_schema_round_trips_and_predicts_by_its_own_formula(tmp_path):
    """save/load keeps every number; the interval is exp(mu +- 1.96 sqrt(z'Cz + tau^2)), computed here by
    hand; a factor beyond the box is named, a held factor at another value too; a bad file is one line."""
    law = fit_law(synthetic(11), draws=20, form=FORM, alternatives=False)
    save_law(tmp_path / "law.json", law)
    back, source = load_law(str(tmp_path / "law.json"))
    assert source == str(tmp_path / "law.json") and back.as_dict() == json.loads(json.dumps(law.as_dict()))
    x = {**BASE, "width": 512, "depth": 48, "warmup": 2000, "vocab": 32000}
    z = np.array([1, math.log(512), math.log(48), math.log1p(2000 / 30)])
    c, cov, tau = np.array(back.best.coef), np.array(back.best.cov), back.best.tau
    sd = math.sqrt(z @ cov @ z + tau ** 2)
    pred = back.predict(x)
    assert pred.lr_star == pytest.approx(math.exp(c @ z), rel=1e-12)
    assert pred.interval == pytest.approx((math.exp(c @ z - 1.96 * sd), math.exp(c @ z + 1.96 * sd)),
                                          rel=1e-3)
    assert pred.extrapolated == ["width 512 > 256", "depth 48 > 16"]
    assert pred.not_modelled == ["vocab 32,000 (held at 2,048)"]
    assert pred.p_collapse(pred.lr_star, back.sigma) == pytest.approx(0.5)
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ConfigError, match=r"--collapse-law .*bad.json: not a megapost-law boundary fit"):
        load_law(str(tmp_path / "bad.json"))
    assert isinstance(Law.from_dict(law.as_dict()), Law)


def _write_results(path: Path, probes) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["variant", "placement", "hidden", "depth", "lr", "warmup", "seed",
                                          "outcome", "final_grad_ratio", "iters", "seq_length", "batch"])
        w.writeheader()
        for p in probes:
            x = p.factors
            for s in range(p.n):
                w.writerow({"variant": "post", "placement": "post", "hidden": int(x["width"]),
                            "depth": int(x["depth"]), "lr": p.lr, "warmup": int(x["warmup"]), "seed": s,
                            "outcome": "collapsed" if s < p.k else "trained",
                            "final_grad_ratio": 1e-9 if s < p.k else 0.5, "iters": int(x["warmup"]) + 130,
                            "seq_length": 32,
                            "batch": 8})
        w.writerow({"variant": "pre", "placement": "pre", "hidden": 64, "depth": 4, "lr": 1.0, "warmup": 0,
                    "seed": 1, "outcome": "trained", "iters": 150, "seq_length": 32, "batch": 8})


def test_the_tool_fits_results_csv_and_validates(tmp_path, monkeypatch, capsys):
    """megapost-law boundary on a results.csv of per-seed rows: the same probes as the fitter gets
    directly (the Pre-Norm row ignored), a law JSON the planner loads, the leave-one-out table over the
    three widths and depths, and the paper-180m test printed."""
    from megapost.study import boundary_cli as fit_collapse_law
    from megapost.study import boundary_report

    probes = synthetic(5)
    (tmp_path / "sweep").mkdir()
    _write_results(tmp_path / "sweep" / "results.csv", probes)
    out = tmp_path / "law.json"
    with pytest.raises(ConfigError, match="no column for \\['vocab', 'heads', 'init'\\]"):
        fit_collapse_law.main([str(tmp_path / "sweep"), "--out", str(out)])
    assert fit_collapse_law.main([str(tmp_path / "sweep"), "--out", str(out), "--defaults",
                                  "vocab=2048,heads=4,init=paper", "--draws", "20", "--loo-draws", "10"]) == 0
    text = capsys.readouterr().out
    law, _ = load_law(str(out))
    assert law.provenance["runs"] == 3 * len(probes) and law.provenance["probes"] == len(probes)
    direct = fit_law(probes, draws=20)
    assert law.best.coef == pytest.approx(direct.best.coef, rel=1e-6)
    loo = law.validation["leave_one_out"]
    assert [(r["factor"], r["value"]) for r in loo] == [("width", 64), ("width", 128), ("width", 256),
                                                        ("depth", 4), ("depth", 8), ("depth", 16)]
    assert all(r["configs"] == 12 for r in loo) and sum(r["covered"] for r in loo) >= 60
    assert "| tokens_per_step | 256 only | not measured (held at 256) |" in text
    assert "paper-180m test" in text and law.validation["paper_180m"]["bracket"] == [6e-4, 8e-4]
    ps = [make_probe(BASE, lr, k, 3) for lr, k in ((1e-3, 0), (2e-3, 1), (3e-3, 2), (4e-3, 1), (5e-3, 3))]
    assert boundary_report.bracket(ps) == (2e-3, 3e-3)  # first majority; last minority below
    assert boundary_report.bracket(ps[:2]) == (2e-3, math.inf)


def test_a_factor_that_never_varies_alone_gets_no_term():
    """decay_iters tied to warmup (130 after it, 150 without): over <= 1.25x it is ignored; a sweep at
    another heads count and seq at once (neither varies alone) is set aside at the base seq."""
    probes = [make_probe({**BASE, "warmup": w, "decay_iters": 150 if w == 0 else 130}, lr, 1, 3)
              for w in (0, 20, 100) for lr in (1e-3, 2e-3)]
    probes += [make_probe({**BASE, "heads": 8, "seq": 16}, 1e-3, 1, 3)]
    probes += [make_probe({**BASE, "width": 128}, 1e-3, 1, 3)]
    kept, aside, held, ignored = separable(probes)
    assert ignored == ["decay_iters"] and held == {"seq": 32}  # heads then varies no more
    assert aside == [probes[6]] and len(kept) == 7
