"""The row every sweep run leaves in a ``results.csv`` (tools/stability_sweep.py, tools/collapse_boundary.py):
the run's full setting, its outcome and whether it ended in the collapsed state. One row per run (per
seed), so a fit can use every seed's outcome. The columns are documented in docs/collapse_study.md
("results.csv columns"); readers should select columns by name (new ones may be appended)."""

from __future__ import annotations

import argparse
import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_write_text

# the setting of a run: every trainer flag the sweep tools vary or fix
SETTINGS = ("variant", "placement", "width", "depth", "heads", "ffn_hidden", "lr", "min_lr", "warmup",
            "train_iters", "micro_batch", "global_batch", "seq_length", "tokens_per_step", "vocab", "init",
            "decay_style", "weight_decay", "clip_grad", "seed", "extra_flags", "data_path")
# what came out (collapse_metrics/analysis/outcome.py), then the collapsed-state decision of the boundary
OUTCOME = ("outcome", "collapsed", "final_loss", "last_loss", "freq_loss", "final_gap", "best_gap",
           "final_tsim", "final_grad_ratio", "transition_step", "delayed", "alarm_step", "alarm_final",
           "warning_step", "collapse_grad_ratio")
RUN = ("seconds", "engine", "flush_denormal")
EVENT = ("event", "event_step", "learned_step")  # the three outcomes, their step (megapost/study/events.py)
FIELDS = SETTINGS + OUTCOME + RUN + EVENT


# trainer flags each cell sets and results.csv records: a pass-through copy would change the run unrecorded
OWN_FLAGS = {"--lr-decay-style": "--decay-style", "--lr": "--lrs", "--min-lr": "--lrs (min-lr = lr/10)",
             "--lr-warmup-iters": "--warmups", "--train-iters": "--iters", "--seed": "--seeds",
             "--num-layers": "--depths", "--hidden-size": "--hidden", "--seq-length": "--seq-length",
             "--micro-batch-size": "--batch", "--global-batch-size": "--batch"}


def check_extra(extra: Sequence[str]) -> None:
    """Refuse a pass-through flag (after ``--``) that the sweep sets itself for every cell."""
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in OWN_FLAGS:
            raise ConfigError(f"{name} after '--': the sweep sets it for every cell and records it in "
                              f"results.csv; use the sweep's {OWN_FLAGS[name]} instead")


def collapsed(result: dict[str, Any], grad_ratio: float) -> bool:
    """The run ended in the collapsed state: outcome.py's ``collapsed`` with a final first/last-layer
    gradient ratio <= ``grad_ratio`` (vanished gradients; <= 0: the outcome alone). A short healthy run
    still on the initial unigram plateau has t_sim ~1 and loss ~L too, but live gradients."""
    ratio = result.get("final_grad_ratio")
    live = ratio is None or (isinstance(ratio, float) and math.isnan(ratio)) or ratio > grad_ratio
    return result["outcome"] == "collapsed" and (grad_ratio <= 0 or not live)


def settings(args: argparse.Namespace, variant: Any, cell: Any, vocab: int) -> dict[str, Any]:
    """The setting of ``cell`` under the sweep flags ``args`` (the values ``cell_argv`` passes)."""
    h = args.hidden
    return {"variant": cell.variant, "placement": variant.placement, "width": h, "depth": cell.depth,
            "heads": args.heads, "ffn_hidden": 3 * h, "lr": cell.lr,
            "min_lr": cell.lr / 10, "warmup": cell.warmup, "train_iters": args.iters,
            "micro_batch": args.batch, "global_batch": args.batch, "seq_length": args.seq_length,
            "tokens_per_step": args.batch * args.seq_length, "vocab": vocab, "init": args.init_variance,
            "decay_style": args.decay_style, "weight_decay": 0.1, "clip_grad": 1.0,
            "seed": cell.seed,
            "extra_flags": " ".join([*variant.flags, *args.extra]), "data_path": args.data_path}


def check_same_setting(done: Path, prev: dict[str, Any], setting: dict[str, Any]) -> None:
    """A finished cell is reused only if it ran this setting (cells of older sweeps carry none)."""
    for key in SETTINGS:
        if key in prev and prev[key] != setting[key]:
            raise ConfigError(f"{done}: finished with {key} = {prev[key]!r}, but this sweep sets "
                              f"{setting[key]!r}; use another --out (or delete the cell)")


def _text(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)  # full precision: the fit reads these
    return "" if value is None else value


def write_csv(path: Path, rows: list[dict[str, Any]], fields: tuple[str, ...] = FIELDS) -> None:
    """``rows`` (missing columns empty; booleans True/False, ``collapsed`` 0/1), atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: _text(r.get(k)) for k in fields})
    atomic_write_text(path, buf.getvalue())
