"""Fit the collapse law P(collapse | lr, x) over every probe's seed outcomes and write it for the planner.

    megapost-law boundary study/results/grid_w20/boundary.json study/results/warmup ... \\
        --out runs/collapse_law/law.json

Inputs: ``results.csv`` files (or folders searched for them; one row per run, the columns of
``/work/study/SCHEMA.md`` / tools/stability_sweep.py, factors missing from a file taken from
``--defaults``) and tools/collapse_boundary.py JSONs (each probe's k/n at the file's settings). A run
counts as collapsed by its ``collapsed`` column when there is one, else when it ended ``collapsed`` with
a final first/last-layer gradient ratio <= --collapse-grad-ratio (the boundary's criterion). Only plain
Post-Norm runs (variant ``post``) are fitted. The fit (``megapost.study.boundary_fit``: probit MLE, forms
by AIC, configuration bootstrap, residual scatter) is written atomically in the one schema of
``megapost.study.boundary_law``; printed: the forms compared, the factor table, the law, the leave-one-out
validation (``--loo``) and the paper-180m test (never data: the paper's runs are GPU runs at 180M).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megapost.config.errors import ConfigError
from megapost.study.boundary_fit import Probe, fit_law, make_probe, separable
from megapost.study.boundary_law import DEFAULT_LAW, FACTORS, INIT_CODE, save_law
from megapost.study.boundary_report import aside_lines, factor_table, law_lines, loo_table, paper_test

ALIASES = {"width": ("width", "hidden", "hidden_size"), "depth": ("depth", "layers", "num_layers"),
           "warmup": ("warmup", "lr_warmup_iters"), "iters": ("iters", "train_iters"),
           "seq": ("seq", "seq_length"), "vocab": ("vocab", "vocab_size"),
           "heads": ("heads", "num_attention_heads"), "init": ("init", "init_variance"),
           "tokens_per_step": ("tokens_per_step", "tokens"),
           "batch": ("batch", "global_batch_size", "global_batch")}
OLD_STUDY_DEFAULTS = {"vocab": 2048.0, "heads": 4.0, "init": 0.0}  # tools/collapse_boundary.py's runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megapost-law boundary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="results.csv files, folders holding them, boundary JSONs")
    p.add_argument("--out", default=str(DEFAULT_LAW), help="the fit JSON (written atomically)")
    p.add_argument("--defaults", default="", metavar="F=V,...",
                   help="factor values for files without that column, e.g. vocab=2048,heads=4,init=paper")
    p.add_argument("--collapse-grad-ratio", type=float, default=1e-2)
    p.add_argument("--draws", type=int, default=200, help="bootstrap refits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loo", default="width,depth", help="factors to leave out one value of, in turn")
    p.add_argument("--loo-draws", type=int, default=60)
    return p


def parse_defaults(text: str) -> dict[str, float]:
    out = {}
    for item in (t for t in text.split(",") if t):
        name, _, value = item.partition("=")
        if name not in ALIASES:
            raise ConfigError(f"--defaults {item!r}: {name!r} is not one of {sorted(ALIASES)}")
        out[name] = INIT_CODE[value] if name == "init" else float(value)
    return out


def _value(row: dict[str, str], name: str, defaults: dict[str, float]) -> float | None:
    for col in ALIASES[name]:
        v = row.get(col)
        if v not in (None, ""):
            return INIT_CODE[v] if name == "init" and v in INIT_CODE else float(v)
    return defaults.get(name)


def row_factors(row: dict[str, str], defaults: dict[str, float], where: str) -> dict[str, float]:
    x = {f: _value(row, f, defaults) for f in FACTORS if f not in ("tokens_per_step", "decay_iters")}
    iters = _value(row, "iters", defaults)
    x["decay_iters"] = None if iters is None or x["warmup"] is None else iters - x["warmup"]
    tokens = _value(row, "tokens_per_step", defaults)
    batch = _value(row, "batch", defaults)
    x["tokens_per_step"] = tokens if tokens is not None else (
        batch * x["seq"] if batch is not None and x["seq"] is not None else None)
    missing = [f for f, v in x.items() if v is None]
    if missing:
        raise ConfigError(f"{where}: no column for {missing} (aliases {[ALIASES[m] for m in missing]}); "
                          "pass them with --defaults F=V,...")
    return x  # type: ignore[return-value]


def is_collapsed(row: dict[str, str], grad_ratio: float) -> bool:
    if row.get("collapsed") not in (None, ""):
        return row["collapsed"].strip().lower() in ("1", "true", "yes")
    ratio = row.get("final_grad_ratio")
    live = ratio not in (None, "") and float(ratio) > grad_ratio
    return row["outcome"] == "collapsed" and not live


def probes_from_csv(path: Path, defaults: dict[str, float], grad_ratio: float) -> tuple[list[Probe], int]:
    """The file's plain Post-Norm runs grouped into probes (configuration, lr): (probes, runs)."""
    counts: dict[tuple, list[int]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            if row.get("variant", "post") != "post" or row.get("placement", "post") != "post":
                continue
            if row.get("outcome") in (None, "") and row.get("collapsed") in (None, ""):
                continue  # a run that did not finish
            x = row_factors(row, defaults, f"{path}:{i}")
            key = (tuple(sorted(x.items())), float(row["lr"]))
            c = counts.setdefault(key, [0, 0])
            c[0] += is_collapsed(row, grad_ratio)
            c[1] += 1
    return [make_probe(dict(x), lr, k, n) for (x, lr), (k, n) in counts.items()], sum(
        n for _, n in counts.values())


def probes_from_boundary(path: Path) -> tuple[list[Probe], int]:
    """A tools/collapse_boundary.py JSON: every probe's k/n at the file's warmup, steps, batch, seq."""
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        base = {"warmup": data["warmup"], "decay_iters": data["iters"] - data["warmup"],
                "seq": data["seq_length"],
                "tokens_per_step": data["batch"] * data["seq_length"], **OLD_STUDY_DEFAULTS}
        probes = [make_probe({**base, "width": b["width"], "depth": b["depth"]}, p["lr"], p["k"], p["n"])
                  for b in data["points"] for p in b["probes"]]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a tools/collapse_boundary.py JSON (missing {e})") from None
    return probes, sum(p.n for p in probes)


def read_inputs(inputs: Sequence[str], defaults: dict[str, float],
                grad_ratio: float) -> tuple[list[Probe], list[dict]]:
    probes, sources = [], []
    for item in inputs:
        path = Path(item)
        files = sorted(path.rglob("results.csv")) if path.is_dir() else [path]
        if path.is_dir() and not files:
            print(f"note: {item}: no results.csv yet; skipped", flush=True)
            continue
        if not all(f.is_file() for f in files):
            raise ConfigError(f"{item}: no such file or folder")
        for f in files:
            got, runs = (probes_from_boundary(f) if f.suffix == ".json"
                         else probes_from_csv(f, defaults, grad_ratio))
            probes += got
            sources.append({"path": str(f), "runs": runs, "probes": len(got)})
    return probes, sources


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    probes, sources = read_inputs(args.inputs, parse_defaults(args.defaults), args.collapse_grad_ratio)
    if not probes:
        raise ConfigError(f"{', '.join(args.inputs)}: no finished plain Post-Norm runs")
    start = time.monotonic()
    probes, aside, held, ignored = separable(probes)
    law = fit_law(probes, draws=args.draws, seed=args.seed, ignore=ignored)
    law.criterion = (f"outcome.py collapsed with final first/last-layer gradient ratio <= "
                     f"{args.collapse_grad_ratio:g} (or the CSV's collapsed column)")
    law.provenance.update(sources=sources, tool="megapost-law boundary",
                          created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print("\n".join(law_lines(law)))
    checks, lines = aside_lines(law, aside, held)
    print("\n".join(lines))
    print("\n".join(factor_table(law, probes)))
    rows, lines = loo_table(probes, law, [f for f in args.loo.split(",") if f], args.loo_draws, args.seed)
    print("\n".join(lines))
    test, lines = paper_test(law)
    print("\n".join(lines))
    law.validation = {"leave_one_out": rows, "paper_180m": test, "set_aside": checks}
    save_law(args.out, law)
    print(f"wrote {args.out} ({sum(s['runs'] for s in sources)} runs, {len(probes)} probes, "
          f"{law.provenance['configs']} configurations; {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
