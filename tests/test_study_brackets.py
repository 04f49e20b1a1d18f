"""tools/study_brackets.py on the shipped study data (study/results): each bracket is the majority vote
of the raw results.csv rows, recomputed here from the CSV alone."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

REPO = Path(__file__).resolve().parents[1]


def vote_bracket(path: Path) -> tuple[float, float]:
    votes: dict[float, list[int]] = defaultdict(list)
    for r in csv.DictReader(path.open(encoding="utf-8")):
        votes[float(r["lr"])].append(int(r["collapsed"]))
    hi = min(lr for lr, v in votes.items() if 2 * sum(v) >= len(v))
    lo = max(lr for lr, v in votes.items() if 2 * sum(v) < len(v) and lr < hi)
    return lo, hi


def test_the_table_holds_each_sweeps_majority_bracket():
    out = subprocess.run([sys.executable, "tools/study_brackets.py", "study/results"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    for sweep in ("warmup/w0", "warmup/w2000", "warmup_depth/L48_w20", "vocab/v32000"):
        lo, hi = vote_bracket(REPO / "study/results" / sweep / "results.csv")
        row = next(line for line in out.splitlines() if line.startswith(f"| {sweep} |"))
        assert f"[{lo:.3g}, {hi:.3g}]" in row, (sweep, row)
