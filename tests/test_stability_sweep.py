"""tools/stability_sweep.py on the tiny corpus: a 1-cell x 2-norm grid through the real trainer writes the
CSV, the phase diagram and the alarm scores; a rerun skips the finished cells (resumable)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from launch_utils import REPO, child_env


def _sweep(tiny_data, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "stability_sweep.py"), "--out", str(out),
           "--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model, "--depths", "2",
           "--lrs", "0.1", "--warmups", "0", "--iters", "4", "--hidden", "32", "--seq-length", "16",
           "--batch", "2", "--interval", "1", "--jobs", "2", "--nice", "0", *extra]
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)


def test_sweep_writes_results_and_resumes(tiny_data, tmp_path):
    proc = _sweep(tiny_data, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert sorted(r["norm"] for r in rows) == ["post", "pre"]
    for r in rows:
        assert r["outcome"] in {"collapsed", "trained", "plateau"} and r["depth"] == "2"
        assert float(r["final_tsim"]) > 0 and r["final_grad_ratio"]
    png = tmp_path / "phase_L2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scores = json.loads((tmp_path / "alarm.json").read_text())
    assert {"recall", "precision", "alarm_minus_transition"} <= set(scores)
    cells = sorted(p.name for p in (tmp_path / "cells").iterdir())
    assert cells == ["post_L2_lr0.1_w0_s1", "pre_L2_lr0.1_w0_s1"]
    logs = {c: (tmp_path / "cells" / c / "train.log").stat().st_mtime_ns for c in cells}
    again = _sweep(tiny_data, tmp_path)  # finished cells are not rerun
    assert again.returncode == 0 and "[sweep] 2/2 cells" in again.stdout
    assert {c: (tmp_path / "cells" / c / "train.log").stat().st_mtime_ns for c in cells} == logs
