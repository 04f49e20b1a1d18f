"""What a collapse_metrics measured step costs against a quiet one, each case in a fresh process.

    python benchmarks/collapse_step_cost.py [--layers 4 --hidden 256 --seq 256 --micro 4 --accum 2]

Cases (megapost's real Trainer and DeepSpeed engine, synthetic batches, the plugin writing its JSONL
and TensorBoard scalars into a temporary run directory): ``none`` (no plugin) and ``plugin`` at
``--collapse-interval 2``, so measured and quiet steps alternate in one warm process. Per case: every
step's wall time, the aten ops dispatched in one quiet and (with the plugin) one measured step
(``megapost.utils.op_count``: every aten op, views included). Prints measured / quiet (median step
times of the plugin process, on the wall clock and on this process's CPU time, which a machine shared
with other jobs disturbs less; the issue-38 target on CPU at 4 x 256, seq 256: <= 1.5), quiet / no
plugin, and ops per quiet step with and without the plugin (equal: nothing is attached on quiet steps).
A measured step is charged its read-back and records (the loop reads them at the next iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from megapost.utils.op_count import AtenOpCounter

TARGET = 1.5


def run_case(b: argparse.Namespace) -> dict[str, Any]:
    """This process: one case, ``b.steps`` timed steps after ``b.warmup``; returns its row."""
    from bench_common import build_trainer

    plugins: tuple = ()
    flags = ["--train-iters", "100000"]
    if b.case == "plugin":
        from collapse_metrics.plugin import CollapseMetricsPlugin

        plugins = (CollapseMetricsPlugin,)
        flags += ["--plugins", "collapse_metrics", "--collapse-interval", "2"]
    with tempfile.TemporaryDirectory(prefix="collapse-step-cost-") as tb:
        trainer, _, _ = build_trainer(b, flags, plugins, tb)
        wants = (lambda s: trainer.plugins[0].wants_step(s)) if plugins else (lambda s: False)
        step = 0
        def train(step: int) -> None:
            float(trainer.train_step(step))  # the step's end on the device (a no-op wait on CPU)
            read = getattr(trainer.plugins[0], "read_pending", None) if plugins else None
            if read is not None:  # the measurement's read-back and records (the loop's next
                read()  # after_iteration), charged to the measured step; a quiet step has nothing pending
            trainer.host.after_iteration(step)

        for _ in range(b.warmup):
            step += 1
            train(step)
        times: list[tuple[int, bool, float, float]] = []
        for _ in range(b.steps):
            step += 1
            start, cpu = time.perf_counter(), time.process_time()
            train(step)
            times.append((step, wants(step), time.perf_counter() - start, time.process_time() - cpu))
        counts = {}
        for kind in ("quiet", "measured") if plugins else ("quiet",):
            step += 1
            if wants(step) != (kind == "measured"):
                step += 1
            with AtenOpCounter() as c:
                train(step)
            counts[kind] = c.total  # every aten op dispatched, views and metadata included
        trainer.close()
    return {"case": b.case, "steps": times, "ops": counts}


def fresh(case: str, b: argparse.Namespace) -> dict[str, Any]:
    """``case`` in a new interpreter (clean allocator, no engine of another case alive)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, os.path.abspath(__file__), "--case", case, "--json", out.name,
                *(f"--{k}={getattr(b, k)}" for k in ("layers", "hidden", "seq", "micro", "accum", "vocab",
                                                     "steps", "warmup", "threads"))]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL if not b.verbose else None)
        with open(out.name) as f:
            return json.load(f)


def summary(none: dict[str, Any], plugin: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for clock, col in (("wall", 2), ("cpu", 3)):
        measured = med(s[col] for s in plugin["steps"] if s[1])
        quiet = med(s[col] for s in plugin["steps"] if not s[1])
        base = med(s[col] for s in none["steps"])
        out[clock] = {"measured_s": measured, "quiet_s": quiet, "none_s": base,
                      "measured_over_quiet": measured / quiet, "quiet_over_none": quiet / base}
    return {**out, "ops_quiet_plugin": plugin["ops"]["quiet"], "ops_quiet_none": none["ops"]["quiet"],
            "ops_measured": plugin["ops"]["measured"], "target": TARGET}


def main() -> None:
    from bench_common import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--steps", type=int, default=12, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--case", choices=("none", "plugin"), help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--verbose", action="store_true")
    b = p.parse_args()
    if b.threads:
        torch.set_num_threads(b.threads)
    if b.case:
        doc = run_case(b)
    else:
        doc = {"shape": f"{b.layers}x{b.hidden}, seq {b.seq}, batch {b.micro}x{b.accum}",
               **summary(fresh("none", b), fresh("plugin", b))}
        for clock in ("wall", "cpu"):
            c = doc[clock]
            print(f"{doc['shape']}, {clock} clock: measured {c['measured_s'] * 1e3:.1f} ms, quiet "
                  f"{c['quiet_s'] * 1e3:.1f} ms, no plugin {c['none_s'] * 1e3:.1f} ms | measured/quiet "
                  f"{c['measured_over_quiet']:.3f} (target <= {TARGET}) | quiet/no plugin "
                  f"{c['quiet_over_none']:.3f}")
        print(f"ops per quiet step: {doc['ops_quiet_plugin']} with the plugin, {doc['ops_quiet_none']} "
              f"without | ops per measured step {doc['ops_measured']}")
    if b.json:
        with open(b.json, "w") as f:
            json.dump(doc, f)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(main())
