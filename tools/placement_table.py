"""The placement comparison: one table (markdown + CSV) and one figure from finished stability sweeps.

    python tools/placement_table.py --sweep toy=runs/placement_study/toy \\
        --sweep delayed=runs/placement_study/delayed --out docs/figures/placement_study

Each ``--sweep NAME=DIR`` is a ``tools/stability_sweep.py --out DIR`` folder; every row of its
``results.csv`` (judged by ``collapse_metrics/analysis/outcome.py``) is one table row: final loss and its
gap to the train split's frequency loss L (mean of the last 5 measured steps), the best gap on the way,
t_sim(X^H) (head input), the first/last-layer gradient-norm ratio, the outcome, the replayed alarm step
and the transition step. Writes ``<out>.md``, ``<out>.csv`` and ``<out>.png`` (one row of panels per
sweep: loss - L, t_sim(X^H) with the transition marked, gradient ratio with the alarm marked), and
``<out>_probabilities.md``: per cell over its seeds, P(collapsed / delayed / plateau / trained) with Wilson
95 % intervals, the transition steps and the final gap's spread.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from collapse_metrics.analysis.outcome import StepRow, read_run
from collapse_metrics.analysis.probabilities import aggregate
from collapse_metrics.analysis.probabilities import markdown as probability_markdown
from stability_sweep import Cell

from megapost.utils.atomic import atomic_path, atomic_write_text

COLUMNS = ("config", "variant", "outcome", "final_loss", "freq_loss", "final_gap", "best_gap", "final_tsim",
           "final_grad_ratio", "alarm_step", "transition_step", "delayed")
HEADER = ("config", "variant", "outcome", "final loss", "L", "gap", "best gap", "t_sim(X^H)",
          "grad ratio first/last", "alarm step", "transition step", "delayed")


def _float(text: str) -> float:
    return float(text) if text not in ("", "None") else math.nan


def _int(text: str) -> int | None:
    return int(float(text)) if text not in ("", "None") else None


def load_sweep(config: str, folder: Path, flag: str = "--sweep") -> list[dict[str, object]]:
    """The sweep's results.csv rows, typed, with the path of each cell's collapse_metrics.jsonl (``flag``
    names the option that gave ``config=folder`` in the error)."""
    path = folder / "results.csv"
    if not path.is_file():
        given = f"{config}={folder}" if config else str(folder)
        raise SystemExit(f"error: {flag} {given}: {path} not found (run tools/stability_sweep.py "
                         f"--out {folder} first)")
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            cell = Cell(r["variant"], int(r["depth"]), float(r["lr"]), int(r["warmup"]), int(r["seed"]))
            gap, freq = _float(r["final_gap"]), _float(r["freq_loss"])
            rows.append({"config": config, "variant": r["variant"], "depth": cell.depth, "lr": cell.lr,
                         "warmup": cell.warmup, "seed": cell.seed, "outcome": r["outcome"],
                         "final_loss": gap + freq, "freq_loss": freq, "final_gap": gap,
                         "best_gap": _float(r["best_gap"]), "final_tsim": _float(r["final_tsim"]),
                         "final_grad_ratio": _float(r["final_grad_ratio"]),
                         "alarm_step": _int(r["alarm_step"]),
                         "transition_step": _int(r["transition_step"]), "delayed": r["delayed"] == "True",
                         "jsonl": folder / "cells" / cell.name / "tensorboard" / "collapse_metrics.jsonl"})
    return rows


def _cells(r: dict[str, object]) -> list[str]:
    def num(key: str, fmt: str) -> str:
        v = r[key]
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    return [str(r["config"]), f"`{r['variant']}`", str(r["outcome"]), num("final_loss", ".2f"),
            num("freq_loss", ".2f"), num("final_gap", "+.2f"), num("best_gap", "+.2f"),
            num("final_tsim", ".3f"), num("final_grad_ratio", ".1e"), num("alarm_step", "d"),
            num("transition_step", "d"), "yes" if r["delayed"] else "no"]


def markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def table_csv(rows: list[dict[str, object]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: f"{v:.6g}" if isinstance(v, float) else "" if v is None else v for k, v in r.items()})
    return buf.getvalue()


def _series(steps: list[StepRow], field: str) -> tuple[list[int], list[float]]:
    pts = [(s.step, getattr(s, field)) for s in steps if getattr(s, field) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def figure(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(str(r["config"]) for r in rows))
    names = list(dict.fromkeys(str(r["variant"]) for r in rows))
    colours = {n: plt.get_cmap("tab10" if len(names) <= 10 else "tab20")(i) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(configs), 3, figsize=(15, 3.4 * len(configs)), dpi=64, squeeze=False)
    for (ax_loss, ax_tsim, ax_ratio), config in zip(axes, configs, strict=True):
        for r in (r for r in rows if r["config"] == config):
            steps = read_run(r["jsonl"]) if Path(r["jsonl"]).is_file() else []
            if not steps:
                print(f"[table] {r['jsonl']} not found or empty: no curves for {r['variant']}",
                      file=sys.stderr)
            c, label = colours[str(r["variant"])], f"{r['variant']} ({r['outcome']})"
            x, loss = _series(steps, "loss")
            ax_loss.plot(x, [v - float(r["freq_loss"]) for v in loss], color=c, lw=1)
            x, tsim = _series(steps, "tsim_head")
            ax_tsim.plot(x, tsim, color=c, lw=1)
            if r["transition_step"] in x:
                ax_tsim.plot(r["transition_step"], tsim[x.index(r["transition_step"])], "o", color=c, ms=7,
                             mfc="none")
            x, ratio = _series(steps, "ratio")
            ratio = [max(v, 1e-16) for v in ratio]  # 0 (both vanished) drawn at the floor
            ax_ratio.plot(x, ratio, color=c, lw=1, label=label)
            if r["alarm_step"] in x:
                ax_ratio.plot(r["alarm_step"], ratio[x.index(r["alarm_step"])], "v", color=c, ms=7)
        ax_loss.axhline(0, color="k", lw=0.8, ls="--")
        ax_loss.set_ylabel(f"{config}\nloss - L (nats)")
        ax_tsim.set_ylabel("t_sim(X^H)  (o: transition)")
        ax_tsim.set_ylim(-0.02, 1.02)
        ax_ratio.set_yscale("log")
        ax_ratio.set_ylabel("grad ratio layer 1 / last  (v: alarm)")
        ax_ratio.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
        for ax in (ax_loss, ax_tsim, ax_ratio):
            ax.set_xlabel("step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    from PIL import Image

    with atomic_path(path) as tmp:  # 64 colours: a small PNG for the docs
        Image.open(buf).convert("RGB").quantize(colors=64).save(tmp, format="PNG", optimize=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="append", required=True, metavar="NAME=DIR",
                   help="a finished tools/stability_sweep.py --out folder, named in the table (repeatable)")
    p.add_argument("--out", required=True, help="path prefix: writes <out>.md, <out>.csv and <out>.png")
    args = p.parse_args(argv)
    rows: list[dict[str, object]] = []
    for spec in args.sweep:
        name, eq, folder = spec.partition("=")
        if not eq or not name or not folder:
            print(f"error: --sweep {spec!r}: write NAME=DIR, e.g. toy=runs/placement_study/toy",
                  file=sys.stderr)
            return 2
        rows += load_sweep(name, Path(folder))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_name(out.name + ".md"), markdown(rows))
    atomic_write_text(out.with_name(out.name + ".csv"), table_csv(rows))
    figure(rows, out.with_name(out.name + ".png"))
    print(markdown(rows), end="")
    keys = ("config", "variant", "depth", "lr", "warmup")  # over the seeds: analysis/probabilities.py
    probs = probability_markdown(aggregate(rows, keys), keys)
    atomic_write_text(out.with_name(out.name + "_probabilities.md"), probs)
    print(probs, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
