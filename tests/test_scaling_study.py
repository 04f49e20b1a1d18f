"""examples/scaling_study.sh end to end at tiny sizes (the real tools and trainer), and
tools/collapse_boundary.py's probing loop against a known threshold."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess

import pytest
from launch_utils import REPO


def _study(tiny_data, runs, parts):
    env = {"CORPUS": tiny_data.prefix, "TOKENIZER": tiny_data.tokenizer_model, "RUNS": str(runs),
           "PARTS": parts, "SEEDS": "1", "GUARD_SEEDS": "1", "JOBS": "2",
           "SIZE_FLAGS": "--hidden 32 --seq-length 16 --batch 2 --iters 6 --interval 1"}
    proc = subprocess.run(["bash", "examples/scaling_study.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for part in parts.split(","):
        assert f"[study] part {part}: " in proc.stdout
    return proc.stdout


@pytest.mark.integration
def test_scaling_study_script_smoke(tiny_data, tmp_path):
    """The outcomes and autopsy parts at tiny sizes on another corpus: the sweep runs both variants over
    the seeds at the delayed settings with SIZE_FLAGS applied; one seed has no pair to dissect."""
    runs = tmp_path / "runs"
    out = _study(tiny_data, runs, "outcomes,autopsy")
    assert "[study] autopsy skipped" in out
    rows = list(csv.DictReader(open(runs / "outcomes" / "results.csv")))
    assert sorted((r["variant"], r["seed"]) for r in rows) == [("post", "1"), ("pre", "1")]
    args = json.loads((runs / "outcomes" / "cells" / "post_L4_lr0.03_w200_s1" / "tensorboard" / "args.json")
                      .read_text())
    assert args["model"]["hidden_size"] == 32 and args["runtime"]["train_iters"] == 6
    assert args["optimizer"]["lr_warmup_iters"] == 200
    assert args["launches"][-1]["data"]["data_path"] == [tiny_data.prefix]
    assert "| post | 4 | 0.03 | 200 | 1 |" in (runs / "outcomes" / "cells.md").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_scaling_study_guard_part(tiny_data, tmp_path):
    """The guard part at tiny sizes: both remedies on both settings, and the rescue tables counted
    against the outcomes part's seeds."""
    runs = tmp_path / "runs"
    _study(tiny_data, runs, "outcomes,guard")
    for name in ("guard_immediate.md", "guard_delayed.md"):
        table = (runs / name).read_text().splitlines()
        assert table[0].startswith("| remedy | rescued / collapsing unguarded |")
        assert [line.split(" | ")[0] for line in table[2:]] == ["| `lr*0.5`", "| `rewarm`"]
    guarded = json.loads((runs / "guard_delayed_rewarm" / "cells" / "post_L4_lr0.03_w200_s1" / "tensorboard"
                          / "args.json").read_text())
    collapse = guarded["plugins"]["collapse_metrics"]
    assert collapse["collapse_guard_remedy"] == "rewarm" and collapse["collapse_guard_on"] == "early"


def _without_training(monkeypatch, collapse_boundary, fake_run) -> None:
    """collapse_boundary with its runs replaced by ``fake_run`` (and no corpus or tokenizer read)."""
    monkeypatch.setattr(collapse_boundary, "run_cell", fake_run)
    monkeypatch.setattr(collapse_boundary, "train_split_frequency_loss",
                        lambda *a: type("F", (), {"aggregated": 6.5})())
    monkeypatch.setattr(collapse_boundary, "SentencePieceTokenizer",
                        lambda m: type("T", (), {"vocab_size": 64}))


def test_boundary_loop_widens_bisects_and_reports(tmp_path, monkeypatch, capsys):
    """collapse_boundary.main with its trainer runs replaced by a known law (collapse iff lr >= 0.05 d^-0.5
    L^-1, two points below the default range's 3e-3): the probing loop widens the bracket where both ends
    collapse, bisects, never probes one lr twice, and writes brackets.json, boundary.json (the fit
    recovers the law), boundary.png and verify.sh."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import collapse_boundary

    calls = []

    def fake_run(args, cell, freq):
        width = int(args.out.rsplit("d", 1)[1])
        calls.append((width, cell.depth, cell.lr, cell.seed))
        collapsed = cell.lr >= 0.05 * width ** -0.5 / cell.depth
        return {"outcome": "collapsed" if collapsed else "trained",
                "final_grad_ratio": 0.0 if collapsed else 1.0}

    _without_training(monkeypatch, collapse_boundary, fake_run)
    out = tmp_path / "b"
    assert collapse_boundary.main(["--out", str(out), "--data-path", str(tmp_path / "d"), "--tokenizer-model",
                                   "t.model", "--widths", "16,64", "--depths", "2,8", "--seeds", "1,2",
                                   "--jobs", "1"]) == 0
    assert len(calls) == len(set(calls))  # no (point, lr, seed) probed twice
    points = json.loads((out / "brackets.json").read_text())
    for b in points:
        true = 0.05 * b["width"] ** -0.5 / b["depth"]
        assert b["status"] == "open" and b["lo"] < true <= b["hi"] and b["bisected"] == 3
        lrs = [p["lr"] for p in b["probes"]]
        assert lrs[:2] == [0.003, 0.1] and (3e-4 in lrs) == (true < 3e-3), (b["width"], b["depth"], lrs)
    fit = json.loads((out / "boundary.json").read_text())["fit"]
    # bracket ratios <= 10^(1/8) or (100/3)^(1/8): log-lr within 0.22 of the truth; 4x in width and depth
    assert fit["b_width"] == pytest.approx(-0.5, abs=0.35) and fit["c_depth"] == pytest.approx(-1.0, abs=0.35)
    assert (out / "boundary.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "verify.sh").read_text().startswith("#!/usr/bin/env bash\npython -m megapost.pretrain")
    assert "[boundary] round 1 done" in capsys.readouterr().out


def test_boundary_from_the_law_with_adaptive_seeds_on_one_point(tmp_path, monkeypatch, capsys):
    """collapse_boundary.main with its runs replaced by a known threshold (collapse iff lr >= 0.01): the
    first bracket is the shipped law's lr*(64, 4) x [1/2, 2] (computed here from the JSON's coefficients),
    each probe of 3 planned seeds stops after 2 agreeing ones, every run is a results.csv row, and a
    one-point grid ends with its bracket (exit 0, no fit)."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import collapse_boundary

    law = REPO / "study" / "results" / "grid_w20" / "boundary.json"
    fit = json.loads(law.read_text())["fit"]
    star = math.exp(fit["log_a"] + fit["b_width"] * math.log(64) + fit["c_depth"] * math.log(4))
    ran = []

    def fake_run(args, cell, freq):
        ran.append((cell.lr, cell.seed))
        hit = cell.lr >= 0.01
        return {"outcome": "collapsed" if hit else "trained", "final_grad_ratio": 0.0 if hit else 1.0,
                "lr": cell.lr, "seed": cell.seed}

    _without_training(monkeypatch, collapse_boundary, fake_run)
    out = tmp_path / "b"
    assert collapse_boundary.main(["--out", str(out), "--data-path", str(tmp_path / "d"), "--tokenizer-model",
                                   "t.model", "--widths", "64", "--depths", "4", "--seeds", "1,2,3", "--jobs",
                                   "2", "--lr-from-law", str(law), "--law-factor", "2", "--bisect-steps",
                                   "2"]) == 0
    lrs = list(dict.fromkeys(lr for lr, _ in ran))
    assert lrs[:2] == pytest.approx([star / 2, star * 2], rel=1e-3)
    assert sorted(s for lr, s in ran if lr == lrs[0]) == [1, 2]  # 2 agreeing seeds decide a 3-seed vote
    assert len(ran) == 2 * len(lrs) == 8
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 8 and sorted({float(r["lr"]) for r in rows}) == sorted(lrs)
    (b,) = json.loads((out / "brackets.json").read_text())
    assert b["lo"] < 0.01 <= b["hi"]
    assert "one grid point: no fit" in capsys.readouterr().out
