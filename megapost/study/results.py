"""The study's shipped data (study/results, documented in docs/study_results.md): results.csv rows, each
run's compact per-step series, and the runs the hazard law is fitted on.

``study/results/<experiment>/results.csv``: one row per run (tools/sweep_results.py's columns).
``study/results/<experiment>/series/<cell>.csv``: step, lr, loss, t_sim_head, grad_ratio of the run
``<cell>`` (tools/stability_sweep.py's cell name), when its series was kept (issue 40's E1-E3).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megapost.study.events import DEFAULT, FAILED, Criterion, Event, from_row, from_series
from megapost.study.hazard import HazardRun, Schedule
from megapost.utils.atomic import atomic_write_text

SERIES_FIELDS = ("step", "lr", "loss", "t_sim_head", "grad_ratio")
HELD = {"seq_length": 32.0, "vocab": 2048.0, "heads": 4.0}  # the hazard's data hold these (others set aside)
HELD_INIT = "paper"
MIN_ROW_WINDOW = 200  # steps at risk a row without series needs (hazard_runs)


@dataclass(frozen=True)
class Row:
    """A results.csv row, where it came from, its series (when kept) and its outcome."""

    experiment: str
    values: Mapping[str, str]
    series: Path | None

    def number(self, key: str) -> float:
        v = self.values.get(key)
        return math.nan if v in (None, "") else float(v)

    @property
    def cell(self) -> str:
        v = self.values
        return f"{v.get('variant', 'post')}_L{int(self.number('depth'))}_lr{self.number('lr'):g}_w" \
               f"{int(self.number('warmup'))}_s{int(self.number('seed'))}"

    @property
    def config(self) -> str:
        v = self.values
        return (f"{self.experiment}: {v['width']}x{v['depth']} w{v['warmup']} T{v['train_iters']} "
                f"tok{v['tokens_per_step']} seq{v['seq_length']} V{v['vocab']} h{v['heads']} {v['init']} "
                f"{self.decay_style}")

    @property
    def decay_style(self) -> str:
        return self.values.get("decay_style") or "cosine"  # the older sweeps hard-coded cosine

    def schedule(self) -> Schedule:
        lr = self.number("lr")
        min_lr = self.number("min_lr")
        return Schedule(lr, lr / 10 if math.isnan(min_lr) else min_lr, int(self.number("warmup")),
                        int(self.number("train_iters")), self.decay_style)

    def event(self, crit: Criterion = DEFAULT) -> Event:
        if self.series is None:
            return from_row(self.values, crit)
        steps, loss, tsim, ratio = read_series(self.series)
        return from_series(steps, loss, tsim, ratio, self.number("freq_loss"), crit)


def read_rows(root: str | Path) -> list[Row]:
    """Every plain Post-Norm row of every results.csv under ``root`` (finished runs only)."""
    root = Path(root)
    out = []
    for path in sorted(root.rglob("results.csv")):
        exp = str(path.parent.relative_to(root))
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                if row.get("variant", "post") != "post" or row.get("outcome") in (None, ""):
                    continue
                r = Row(exp, row, None)
                series = path.parent / "series" / f"{r.cell}.csv"
                out.append(Row(exp, row, series if series.is_file() else None))
    return out


def hazard_runs(rows: Sequence[Row], crit: Criterion = DEFAULT,
                min_window: int = MIN_ROW_WINDOW) -> tuple[list[HazardRun], list[Row]]:
    """(the runs the hazard is fitted on, the rows set aside): runs that learned, at the held sequence,
    vocabulary, heads and init; at risk from the step they learned. A row without series is at risk from
    step 0 (when it learned is unknown) and is used only when its window at risk (train_iters - K) is at
    least ``min_window`` steps: in the 150-step runs of the older sweeps (50 steps at risk) surviving
    cannot be told from not having learned yet."""
    runs, aside = [], []
    for r in rows:
        held = all(r.number(k) == v for k, v in HELD.items()) and r.values.get("init") == HELD_INIT
        short = r.series is None and r.number("train_iters") - crit.sustain < min_window
        if not held or short:
            aside.append(r)
            continue
        ev = r.event(crit)
        if ev.kind == FAILED:
            continue
        x = {"width": r.number("width"), "depth": r.number("depth"), "warmup": r.number("warmup"),
             "tokens_per_step": r.number("tokens_per_step")}
        runs.append(HazardRun(r.config, x, r.schedule(), ev, ev.learned_step or 0, int(r.number("seed"))))
    return runs, aside


def read_series(path: Path) -> tuple[list[int], list[float | None], list[float | None], list[float | None]]:
    steps, loss, tsim, ratio = [], [], [], []

    def num(v: str) -> float | None:
        return None if v == "" else float(v)

    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            steps.append(int(row["step"]))
            loss.append(num(row["loss"]))
            tsim.append(num(row["t_sim_head"]))
            ratio.append(num(row["grad_ratio"]))
    return steps, loss, tsim, ratio


def _step_records(jsonl: Path) -> dict[int, dict]:
    """The step records of a collapse_metrics.jsonl by step (a later record of a step supersedes)."""
    by_step: dict[int, dict] = {}
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "layer" not in rec and "step" in rec:
                    by_step.setdefault(int(rec["step"]), {}).update(rec)
    return by_step


def jsonl_series(jsonl: Path) -> tuple[list[int], list, list, list, float]:
    """(steps, loss, t_sim_head, grad_ratio, corpus frequency loss) of a run's collapse_metrics.jsonl."""
    by_step = _step_records(jsonl)
    steps = sorted(by_step)

    def col(key: str) -> list[float | None]:
        out = []
        for s in steps:
            v = by_step[s].get(key)
            out.append(None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v))
        return out

    freq = next((by_step[s]["freq_loss_corpus"] for s in steps if by_step[s].get("freq_loss_corpus")),
                math.nan)
    return steps, col("loss"), col("t_sim_head"), col("grad_ratio"), float(freq)


def export_series(run_dir: Path, schedule: Schedule, out: Path) -> None:
    """A run's compact series (SERIES_FIELDS) from its tensorboard/collapse_metrics.jsonl, written
    atomically. lr is the schedule's at the step (the lr of the step's update)."""
    steps, loss, tsim, ratio, _ = jsonl_series(run_dir / "tensorboard" / "collapse_metrics.jsonl")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SERIES_FIELDS)

    def text(v: float | None) -> str:
        return "" if v is None else f"{v:.6g}"

    for i, step in enumerate(steps):
        lr = schedule.at(np.array([max(step - 1, 0)]))[0]
        w.writerow([step, f"{lr:.6g}", text(loss[i]), text(tsim[i]), text(ratio[i])])
    atomic_write_text(out, buf.getvalue())
