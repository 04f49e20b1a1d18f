"""megapost-law: refit the delayed-collapse law from the shipped study data, or bring a sweep's runs in.

    megapost-law fit [--results study/results] [--out megapost/study/hazard_law_post.json]
        relabels every run (three outcomes), fits the hazard law with its alternatives, prints the tables,
        the leave-one-configuration-out coverage and the paper-180m lines, and writes the law (atomic)
    megapost-law collect SWEEP_DIR EXPERIMENT [--results study/results]
        copies SWEEP_DIR/results.csv and each finished cell's compact series into
        study/results/EXPERIMENT/ (results.csv, series/<cell>.csv)

    megapost-law boundary INPUTS... [--out FILE]
        the failure-to-start (boundary) law: probit fit over every probe's seeds (boundary_cli.py; the
        factor study's folders and study/results/grid_w20/boundary.json: see the Makefile's law target)
    megapost-law events SWEEP_DIR
        prints one JSON: every cell's outcome and its step (finished or not: a run still going is judged
        on the steps it has), read from each cell's collapse_metrics.jsonl

(``make law`` runs ``fit``; ``python -m megapost.study`` is the same command.)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megapost.config.errors import ConfigError
from megapost.study import boundary_cli
from megapost.study.events import DEFAULT, from_series
from megapost.study.fit import fit_law, loo_coverage
from megapost.study.law import SHIPPED, save
from megapost.study.report import fit_lines, loo_lines, paper_lines, relabel_table
from megapost.study.results import export_series, hazard_runs, jsonl_series, read_rows


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
    sub.add_parser("boundary", help="the failure-to-start law (megapost-law boundary --help)")
    e = sub.add_parser("events", help="every cell's outcome and step, one JSON")
    e.add_argument("sweep")
    return p


CELL = re.compile(r"^(?P<variant>[^_]+)_L(?P<depth>\d+)_lr(?P<lr>[^_]+)_w(?P<warmup>\d+)_s(?P<seed>\d+)$")


def events(sweep: Path) -> int:
    out = []
    for cell in sorted((sweep / "cells").glob("*")):
        m = CELL.match(cell.name)
        jsonl = cell / "tensorboard" / "collapse_metrics.jsonl"
        if m is None or not jsonl.is_file():
            continue
        steps, loss, tsim, ratio, freq = jsonl_series(jsonl)
        rec = {"cell": cell.name, "lr": float(m["lr"]), "seed": int(m["seed"]), "depth": int(m["depth"]),
               "warmup": int(m["warmup"]), "finished": (cell / "outcome.json").is_file(),
               "last_step": steps[-1] if steps else None, "freq_loss": freq}
        if steps:
            ev = from_series(steps, loss, tsim, ratio, freq)
            rec.update(event=ev.kind, step=ev.step, learned_step=ev.learned_step,
                       at_risk_until=ev.at_risk_until,
                       final_loss=next((v for v in reversed(loss) if v is not None), None))
        out.append(rec)
    print(json.dumps({"sweep": str(sweep), "criterion": DEFAULT.describe(), "runs": out}, indent=1))
    return 0


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["boundary"]:
        return boundary_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "events":
        return events(Path(args.sweep))
    if args.command == "collect":
        return collect(Path(args.sweep), args.experiment, Path(args.results))
    return fit_command(args.results, args.out, not args.no_influence)


if __name__ == "__main__":
    sys.exit(main())
