"""The measured bracket of lr* of every sweep folder of a collapse study, as a markdown table.

    python tools/study_brackets.py study/results   # the shipped study

One row per configuration (a sweep's results.csv may hold one): the sweep folder, the factors that differ
from the study's base (d 64 x 4 layers, warmup 20, 150 steps, seq 32 x 8, 2k vocabulary, 4 heads, paper
init), the bracket (highest lr where most seeds trained, lowest where most collapsed; the boundary tool's
vote) and every probe as lr: collapsed/seeds. Wall time and runs per hour come from each folder's rows
(the ``seconds`` column: the runs' own time, summed).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from pathlib import Path

from megapost.study.boundary_cli import probes_from_csv
from megapost.study.boundary_fit import groups
from megapost.study.boundary_report import bracket

BASE = {"width": 64, "depth": 4, "warmup": 20, "decay_iters": 130, "seq": 32, "tokens_per_step": 256,
        "vocab": 2048, "heads": 4, "init": 0}


def setting(x: dict[str, float]) -> str:
    diff = [f"{k} {x[k]:g}" for k in BASE if x[k] != BASE[k]]
    return ", ".join(diff) or "base"


def rows(root: Path) -> list[tuple[str, str, str, str, int, float]]:
    out = []
    for f in sorted(root.rglob("results.csv")):
        probes, runs = probes_from_csv(f, {}, 1e-2)
        with open(f, newline="", encoding="utf-8") as fh:
            secs = sum(float(r.get("seconds") or 0) for r in csv.DictReader(fh))
        for ps in groups(probes).values():
            lo, hi = bracket(ps)
            votes = ", ".join(f"{p.lr:.3g}: {p.k}/{p.n}" for p in sorted(ps, key=lambda p: p.lr))
            out.append((str(f.parent.relative_to(root)), setting(ps[0].factors), f"[{lo:.3g}, {hi:.3g}]",
                        votes, runs, secs))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="the study folder (sweep folders holding results.csv)")
    args = p.parse_args(argv)
    table = rows(Path(args.root))
    print("| sweep | setting (vs base) | bracket of lr* | probes (lr: collapsed/seeds) | runs | run-s |")
    print("|---|---|---|---|---|---|")
    for name, s, b, votes, runs, secs in table:
        print(f"| {name} | {s} | {b} | {votes} | {runs} | {secs:.0f} |")
    runs = sum(r[4] for r in table)
    secs = sum(r[5] for r in table)
    print(f"\n{len(table)} configurations, {runs} runs, {secs / 3600:.2f} run-hours "
          f"({runs / max(secs / 3600, 1e-9):.0f} runs per run-hour)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
