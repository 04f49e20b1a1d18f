"""The planner's one collapse verdict (issue 52 item 4): one ``collapse risk:`` line, plain words, each law's
own numbers beside it, the worse law's level as the verdict."""

from __future__ import annotations

import json

import pytest

from megapost.plan.__main__ import main as plan_main
from megapost.plan.verdict import verdict

ISSUE = ["--preset", "paper-180m", "--norm-position", "post", "--lr-warmup-iters", "2000"]
JARGON = ("cannot see past", "hazard law", "decay_iters", "tokens_per_step", "failure-to-start law",
          "(> x10)", "delayed collapse (", "extrapolated --")


@pytest.mark.parametrize("lr", [None, "6e-4", "8e-4", "1.8e-3"])
def test_the_issue_command_prints_one_collapse_line_in_plain_words(capsys, lr):
    extra = [] if lr is None else ["--lr", lr]
    plan_main(ISSUE + extra)
    out = capsys.readouterr().out.splitlines()
    risky = [ln for ln in out if "collapse" in ln.lower()]
    assert len(risky) == 1 and risky[0].startswith("collapse risk: "), out
    line = risky[0]
    for word in JARGON:
        assert word not in line, (word, line)
    plan_main([*ISSUE, *extra, "--json"])
    rec = json.loads(capsys.readouterr().out)
    start, delayed = rec["collapse_risk"], rec["delayed_collapse"]
    # each law's own numbers, unrefitted, are in the line
    for r in (start, delayed):
        lo, hi = r["interval"]
        assert f"predicted lr* {r['lr_star']:.3g} [{lo:.3g}, {hi:.3g}]" in line
    p, (plo, phi) = delayed["p_collapse"], delayed["p_interval"]
    assert f"P {p:.2f} [{plo:.2f}, {phi:.2f}]" in line
    # the shipped failure-to-start interval is wider than x10: no P for it, and the line says so
    assert start["p_collapse"] is None and "no P" in line
    # the verdict: the delayed law's P band (by hand: above 1/2 high, below low, else uncertain), since
    # the start law's lr sits inside its interval (uncertain)
    level = "high" if plo > 0.5 else "low" if phi < 0.5 else "uncertain"
    assert start["interval"][0] <= float(lr or 8e-4) <= start["interval"][1]
    want = "uncertain" if level == "low" else level
    assert line.startswith(f"collapse risk: {want} at lr {float(lr or 8e-4):.3g} ("), line
    assert "width 512 (measured up to 128)" in line and "sequence length 2,048 (measured up to 256)" in line


def _rec(lo, hi, p=None, band=None, extrapolated=()):
    return {"available": True, "lr_star": (lo * hi) ** 0.5, "interval": [lo, hi], "p_collapse": p,
            "p_interval": band, "extrapolated": list(extrapolated), "not_modelled": []}


def test_the_worse_law_is_the_verdict_and_dominates():
    start = _rec(1e-4, 2e-4, p=0.9)  # lr 3e-4 above the start law's interval: high
    delayed = _rec(1e-4, 1e-3, p=0.3, band=[0.1, 0.6])  # band across 1/2: uncertain
    line = verdict(start, delayed, 3e-4, 1000)
    assert line.startswith("collapse risk: high at lr 0.0003 (failing to start dominates) -- "
                           "failing to start")
    assert "collapsing after it has learned (by step 1,000): uncertain, P 0.30 [0.10, 0.60]" in line
    low = verdict(_rec(1e-3, 2e-3, p=0.01), _rec(1e-4, 1e-3, p=0.8, band=[0.6, 0.9]), 3e-4, 1000)
    assert low.startswith("collapse risk: high at lr 0.0003 (a delayed collapse dominates) -- collapsing")
    out = verdict(_rec(1e-4, 1e-3, p=0.5, extrapolated=["seq 2,048 > 256"]),
                  {"available": False, "line": "delayed collapse: Post-Norm only"},
                  3e-4, 1000)
    assert out.startswith("collapse risk: uncertain at lr 0.0003 "
                          "(failing to start dominates; extrapolated)")
    assert out.endswith("extrapolated beyond the measured runs: sequence length 2,048 (measured up to 256)")
