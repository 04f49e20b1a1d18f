"""The planner's collapse-risk line from the collapse law (megapost/plan/collapse_risk.py): the user's own
warmup, batch, sequence, steps and init; ``extrapolated`` outside the measured box; the shipped fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy.stats import norm

from megapost.config.errors import ConfigError
from megapost.plan.collapse_risk import collapse_risk
from megapost.study.boundary_law import SHIPPED_LABEL, Branch, Form, Law, load_law, save_law

REPO = Path(__file__).resolve().parents[1]
FACTORS = ("width", "depth", "warmup", "tokens_per_step", "decay_iters", "seq", "init")
COEF = [math.log(2.0), -0.5, -1.0, -0.1, -0.2, 0.3, -0.4, 0.4]  # const, 5 logs, init, warmup:log1p
SIGMA, TAU = 0.2, 0.1


def _law() -> Law:
    form = Form(("width", "depth", "tokens_per_step", "decay_iters", "seq", "init", "warmup"), "log1p", 100.0)
    n = len(form.columns())
    cov = [[1e-4 if i == j else 0.0 for j in range(n)] for i in range(n)]
    box = {"width": [64, 512], "depth": [4, 48], "warmup": [0, 2000], "tokens_per_step": [256, 4096],
           "decay_iters": [150, 2000], "seq": [32, 256], "vocab": [2048, 2048], "heads": [4, 4],
           "init": [0, 1]}
    return Law(Branch(form, COEF, cov, TAU), SIGMA, box, {"vocab": 2048.0, "heads": 4.0},
               provenance={"runs": 1})


def _x(**kw) -> dict:
    return {"width": 128, "depth": 8, "warmup": 100, "tokens_per_step": 1024, "decay_iters": 500, "seq": 64,
            "vocab": 2048, "heads": 4, "init": 0, **kw}


def _by_hand(x: dict) -> tuple[float, float]:
    """(log lr*, predictive sd) from COEF and the diagonal covariance, written out."""
    z = [1, math.log(x["width"]), math.log(x["depth"]), math.log(x["tokens_per_step"]),
         math.log(x["decay_iters"]),
         math.log(x["seq"]), x["init"], math.log(1 + x["warmup"] / 100)]
    sd = math.sqrt(1e-4 * sum(v * v for v in z) + TAU ** 2)
    return sum(c * v for c, v in zip(COEF, z, strict=True)), sd


def test_the_risk_follows_the_runs_own_factors():
    law = _law()
    mu, sd = _by_hand(_x())
    star = math.exp(mu)
    hi = collapse_risk(law, "f", "post", _x(), 3 * star)
    assert hi["risk"] == "high" and hi["lr_star"] == pytest.approx(star, rel=1e-12)
    assert hi["interval"] == pytest.approx([star * math.exp(-1.96 * sd), star * math.exp(1.96 * sd)],
                                           rel=1e-3)
    assert hi["p_collapse"] == pytest.approx(norm.cdf(math.log(3) / math.hypot(SIGMA, sd)), rel=1e-9)
    assert hi["line"].startswith(f"collapse risk: high -- lr {3 * star:.3g} = 3 x predicted lr* {star:.3g}")
    assert collapse_risk(law, "f", "post", _x(), star / 3)["risk"] == "low"
    assert collapse_risk(law, "f", "post", _x(), star)["risk"] == "uncertain"
    for factor, value in (("warmup", 1000), ("tokens_per_step", 4096), ("decay_iters", 2000), ("seq", 256),
                          ("init", 1)):
        moved = collapse_risk(law, "f", "post", _x(**{factor: value}), star)["lr_star"]
        assert moved == pytest.approx(math.exp(_by_hand(_x(**{factor: value}))[0]), rel=1e-12), factor
        assert moved != pytest.approx(star, rel=1e-3), factor
    assert "fitted for --norm-position post, not pre" in collapse_risk(law, "f", "pre", _x(), 1e-3)["line"]


def test_outside_the_box_it_says_extrapolated_with_the_ratio():
    law = _law()
    x = _x(width=4096, vocab=32000)
    r = collapse_risk(law, "f", "post", x, 1e-6)
    star = math.exp(_by_hand(x)[0])
    assert r["risk"] == "extrapolated" and "low" not in r["line"].split(" -- ")[0]
    assert f"= {1e-6 / star:.2g} x predicted lr* {star:.3g}" in r["line"]
    assert "outside the measured box: width 4,096 > 512" in r["line"]
    assert "not measured, held at the fit's value: vocab 32,000 (held at 2,048)" in r["line"]
    assert r["extrapolated"] == ["width 4,096 > 512"]
    held = collapse_risk(law, "f", "post", _x(vocab=32000), 1e-6)  # inside the box, but a held factor moved
    assert held["risk"] == "extrapolated" and held["extrapolated"] == []


def test_the_planner_passes_warmup_batch_seq_steps_and_init(tmp_path, capsys):
    from megapost.plan.__main__ import main as plan_main

    path = tmp_path / "law.json"
    save_law(path, _law())
    argv = ["--preset", "paper-180m", "--norm-position", "post", "--lr", "8e-4", "--gpus", "8",
            "--collapse-law", str(path)]
    for extra, x in (([], _x(width=512, depth=48, warmup=2000, tokens_per_step=256 * 2048, decay_iters=38000,
                                seq=2048, vocab=32000)),
                     (["--lr-warmup-iters", "0", "--global-batch-size", "64", "--seq-length", "1024",
                       "--train-iters", "1000", "--init-variance", "std"],
                      _x(width=512, depth=48, warmup=0, tokens_per_step=64 * 1024, decay_iters=1000, seq=1024,
                         vocab=32000, init=1))):
        plan_main([*argv, *extra, "--json"])
        line = json.loads(capsys.readouterr().out)["collapse_risk"]["line"]
        star = math.exp(_by_hand(x)[0])
        assert line.startswith(f"collapse risk: extrapolated -- lr 0.0008 = {8e-4 / star:.2g} x "
                               f"predicted lr* {star:.3g}"), line
        assert f"warmup {x['warmup']:g}, {x['tokens_per_step']:,.0f} tokens/step" in line


def test_the_shipped_fit_loads_and_an_old_boundary_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEGAPOST_COLLAPSE_LAW", raising=False)
    law, source = load_law(None)
    assert source == SHIPPED_LABEL and law.placement == "post" and law.provenance["runs"] > 100
    assert all((REPO / s["path"]).is_file() for s in law.provenance["sources"])
    old = REPO / "study" / "results" / "grid_w20" / "boundary.json"  # the old study's probes: data
    with pytest.raises(ConfigError, match="not a megapost-law boundary fit.*refit with"):
        load_law(str(old))
    assert json.loads(old.read_text())["points"]
