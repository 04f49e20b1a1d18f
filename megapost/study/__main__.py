"""megapost-law: refit the delayed-collapse law from the shipped study data, or bring a sweep's runs in.

    megapost-law fit [--results study/results] [--out megapost/study/hazard_law_post.json]
        relabels every run (three outcomes), fits the hazard law with its alternatives, prints the tables,
        the leave-one-configuration-out coverage and the paper-180m lines, and writes the law (atomic)
    megapost-law collect SWEEP_DIR EXPERIMENT [--results study/results]
        copies SWEEP_DIR/results.csv and each finished cell's compact series into
        study/results/EXPERIMENT/ (results.csv, series/<cell>.csv)

(``make law`` runs ``fit``; ``python -m megapost.study`` is the same command.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megapost.config.errors import ConfigError
from megapost.study.events import DEFAULT
from megapost.study.fit import fit_law, loo_coverage
from megapost.study.law import SHIPPED, save
from megapost.study.report import fit_lines, loo_lines, paper_lines, relabel_table
from megapost.study.results import export_series, hazard_runs, read_rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megapost-law", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="refit the law from the shipped data")
    f.add_argument("--results", default="study/results")
    f.add_argument("--out", default=str(SHIPPED))
    f.add_argument("--no-influence", action="store_true", help="skip the leave-one-configuration-out refits")
    c = sub.add_parser("collect", help="bring a tools/stability_sweep.py folder into study/results")
    c.add_argument("sweep")
    c.add_argument("experiment")
    c.add_argument("--results", default="study/results")
    return p


def collect(sweep: Path, experiment: str, results: Path) -> int:
    src = sweep / "results.csv"
    if not src.is_file():
        raise ConfigError(f"{src}: no results.csv (is {sweep} a tools/stability_sweep.py --out folder?)")
    dest = results / experiment
    (dest / "series").mkdir(parents=True, exist_ok=True)
    tmp = dest / ".results.csv.tmp"
    shutil.copyfile(src, tmp)
    tmp.replace(dest / "results.csv")
    count = 0
    for row in read_rows(dest):
        cell = sweep / "cells" / row.cell
        if (cell / "tensorboard" / "collapse_metrics.jsonl").is_file():
            export_series(cell, row.schedule(), dest / "series" / f"{row.cell}.csv")
            count += 1
    print(f"{dest}: results.csv and {count} series")
    return 0


def fit_command(results: str, out: str, influence: bool) -> int:
    start = time.monotonic()
    rows = read_rows(results)
    if not rows:
        raise ConfigError(f"--results {results}: no results.csv with finished Post-Norm runs")
    print("\n".join(relabel_table(rows)))
    law = fit_law(rows, DEFAULT, influence=influence)
    print("\n".join(fit_lines(law)))
    runs, _ = hazard_runs(rows)
    loo = loo_coverage(runs, law.best.form)
    print("\n".join(loo_lines(loo)))
    print("\n".join(paper_lines(law)))
    law.validation = {"leave_one_configuration_out": loo}
    law.provenance.update(results=results, tool="megapost-law fit",
                          created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    save(out, law)
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "collect":
        return collect(Path(args.sweep), args.experiment, Path(args.results))
    return fit_command(args.results, args.out, not args.no_influence)


if __name__ == "__main__":
    sys.exit(main())
