"""tools/guard_rescue.py: P(rescued) per remedy from the sweeps' results.csv, counted seed by seed."""

from __future__ import annotations

import csv
import importlib
import sys

import pytest
from launch_utils import REPO

FIELDS = ("variant", "seed", "outcome", "final_gap")
REST = {"depth": 4, "lr": 0.03, "warmup": 200, "freq_loss": 6.5, "best_gap": -0.5, "final_tsim": 0.5,
        "final_grad_ratio": 1.0, "alarm_step": "", "transition_step": "", "delayed": False}


@pytest.fixture
def guard_rescue(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    sys.modules.pop("guard_rescue", None)
    return importlib.import_module("guard_rescue")


def _sweep(folder, rows):
    folder.mkdir()
    with (folder / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*FIELDS, *REST])  # stability_sweep's columns
        w.writeheader()
        w.writerows({**dict(zip(FIELDS, r, strict=True)), **REST} for r in rows)
    return str(folder)


def test_rescued_counts_only_collapsing_seeds_that_end_trained(guard_rescue, tmp_path, capsys):
    unguarded = _sweep(tmp_path / "none", [
        ("post", 1, "collapsed", 0.02), ("post", 2, "collapsed", 0.0), ("post", 3, "plateau", -0.1),
        ("post", 4, "collapsed", 0.04), ("pre", 1, "trained", -1.0), ("pre", 2, "trained", -1.2)])
    guarded = _sweep(tmp_path / "g", [
        ("post", 1, "trained", -0.8), ("post", 2, "plateau", -0.2), ("post", 3, "collapsed", 0.0),
        ("post", 4, "trained", -0.6), ("post", 9, "trained", -0.5)])  # seed 9: not in the unguarded sweep
    out = tmp_path / "t.md"
    argv = ["--unguarded", unguarded, "--guarded", f"lr*0.5={guarded}", "--out", str(out)]
    assert guard_rescue.main(argv) == 0
    row = out.read_text().splitlines()[2]
    # at risk: seeds 1, 2, 4; rescued: 1, 4 (2 ends on a plateau); Wilson(2, 3) = [0.21, 0.94]
    assert row.startswith("| `lr*0.5` | 2/3 [0.21, 0.94] (seeds 1,4) | 1 | 1/4 [0.05, 0.70] | 3/4 |")
    # final gaps over seeds 1-4: guarded (-0.8-0.2+0-0.6)/4, unguarded (0.02+0-0.1+0.04)/4, Pre-Norm 1-2
    assert row.endswith(f"| {-1.6 / 4:+.2f} | {-0.04 / 4:+.2f} | {-1.1:+.2f} |")
    assert capsys.readouterr().out.strip() == out.read_text().strip()


def test_a_missing_sweep_is_one_line(guard_rescue, tmp_path, capsys):
    assert guard_rescue.main(["--unguarded", str(tmp_path / "nope"), "--guarded", f"x={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "results.csv" in err and len(err.strip().splitlines()) == 1


def test_no_seed_at_risk_counts_nothing(guard_rescue, tmp_path):
    unguarded = _sweep(tmp_path / "none", [("post", 1, "trained", -0.5)])
    guarded = _sweep(tmp_path / "g", [("post", 1, "trained", -0.6)])
    r = guard_rescue.rescue_rows(guard_rescue.read(unguarded, "post", "--unguarded", ""),
                                 guard_rescue.read(guarded, "post", "--guarded", "g"))
    assert (r["rescued"], r["risk"], r["seeds"]) == ([], [], [1])
