"""Files of the per-cell probabilities (``probabilities.py``): ``cells.csv``, ``cells.md``, ``cells.json``
and one figure per depth (colour = P(collapse), the white ring's size = the Wilson interval's width)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megapost.plugin_api import atomic_write_text

from .probabilities import OUTCOMES, aggregate, markdown

CELL_KEYS = ("variant", "depth", "lr", "warmup")


def flat_row(row: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    out = {k: row[k] for k in keys}
    out["n"] = row["n"]
    for o in OUTCOMES:
        out.update({f"p_{o}": row[o]["p"], f"p_{o}_lo": row[o]["lo"], f"p_{o}_hi": row[o]["hi"]})
    out["transition_steps"] = " ".join(str(s) for s in row["transition_steps"])
    for k in ("final_gap_mean", "final_gap_std", "final_gap_min", "final_gap_max"):
        out[k] = row[k]
    return out


def write_cells(out: Path, runs: Sequence[dict[str, Any]], keys: Sequence[str] = CELL_KEYS
                ) -> list[dict[str, Any]]:
    """Aggregate ``runs`` per cell and write ``cells.{csv,md,json}`` under ``out`` (atomically)."""
    rows = aggregate(runs, keys)
    flat = [flat_row(r, keys) for r in rows]
    buf = io.StringIO()
    if flat:
        w = csv.DictWriter(buf, fieldnames=list(flat[0]))
        w.writeheader()
        for r in flat:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    atomic_write_text(out / "cells.csv", buf.getvalue())
    atomic_write_text(out / "cells.md", markdown(rows, keys))
    atomic_write_text(out / "cells.json", json.dumps(rows, indent=1))
    return rows


def probability_figure(path: Path, depth: int, rows: Sequence[dict[str, Any]]) -> None:
    """One lr x warmup panel per variant; each cell a square coloured by P(collapsed) with ``k/n``, and a
    white ring whose diameter grows with the 95 % interval's width (full square: width 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(str(r["variant"]) for r in rows))
    cols = min(4, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows + 0.5), dpi=90, squeeze=False)
    lrs = sorted({float(r["lr"]) for r in rows})
    warmups = sorted({int(r["warmup"]) for r in rows})
    cmap = plt.get_cmap("RdYlGn_r")
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        for r in (r for r in rows if r["variant"] == name):
            x, y, p = lrs.index(float(r["lr"])), warmups.index(int(r["warmup"])), r["collapsed"]
            ax.add_patch(plt.Rectangle((x - 0.45, y - 0.45), 0.9, 0.9, color=cmap(p["p"])))
            ax.scatter(x, y, s=2400 * (p["hi"] - p["lo"]) ** 2, facecolors="none", edgecolors="white", lw=2)
            ax.annotate(f"{p['k']}/{p['n']}\n[{p['lo']:.2f},{p['hi']:.2f}]", (x, y), ha="center",
                        va="center", fontsize=7)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(warmups)), [str(w) for w in warmups])
        ax.set_xlim(-0.5, len(lrs) - 0.5)
        ax.set_ylim(-0.5, len(warmups) - 0.5)
        ax.set_xlabel("peak lr")
        ax.set_ylabel("warmup steps")
        ax.set_title(f"{name}, {depth} layers: P(collapse)", fontsize=9)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=axes.ravel().tolist(), label="P(collapsed)", shrink=0.8)
    fig.suptitle("collapse probability over seeds (white ring: width of the Wilson 95 % interval)",
                 fontsize=9)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
