"""Cost of the collapse-metrics plugin on the real training step (megapost's Trainer + DeepSpeed engine).

One process, one engine, three variants run in blocks of ``--block`` optimizer steps, rotated round by
round so machine noise hits all alike: no plugin, the plugin at ``--collapse-interval 1`` and at 100
(one measured step per block of 100), and no plugin with ``--collapse-guard``'s in-memory snapshot
(``Trainer.snapshot``: parameters and optimizer state copied to host memory) every ``--guard-interval``
M steps, its only per-step cost. The plugin writes its TensorBoard scalars, JSONL and heatmap as in
a run. Prints the median block-time ratios against no plugin (targets <= 1.15 and <= 1.01).

    python benchmarks/collapse_overhead.py [--layers 4 --hidden 256 --seq 256 --micro 4 --accum 2]

Ratios are medians over rounds of (variant block time / no-plugin block time of the same round), on
the wall clock and on this process's CPU time. On a CPU shared with other jobs read the CPU-time line
and pass ``--threads 1``: a busy machine makes every multi-threaded kernel wait for a descheduled
worker thread, which swamps what is being measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from bench_common import add_model_args, build_trainer
from collapse_metrics.plugin import CollapseMetricsPlugin

TARGETS = {1: 1.15, 100: 1.01}


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [t for v in tree for t in _tensors(v)] if isinstance(tree, (list, tuple)) else []


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--block", type=int, default=100, help="optimizer steps per timed block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--guard-interval", type=int, default=50, help="M: snapshot every M steps")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--bf16", action="store_true")
    b = p.parse_args()
    if b.threads:
        torch.set_num_threads(b.threads)
    with tempfile.TemporaryDirectory(prefix="collapse-overhead-") as tb_dir:
        trainer, _, _ = build_trainer(b, ["--plugins", "collapse_metrics", *(["--bf16"] if b.bf16 else [])],
                                    [CollapseMetricsPlugin], tb_dir)
        plugin = trainer.plugins[0]
        guard = f"snapshot every {b.guard_interval}"
        variants = {"none": None, "interval 1": 1, "interval 100": 100, guard: None}
        steps = dict.fromkeys(variants, 0)
        clocks = {"wall": time.perf_counter, "cpu": time.process_time}
        times = {clock: {name: [] for name in variants} for clock in clocks}

        def block(name: str, n: int) -> None:
            interval = variants[name]
            trainer.plugins[:] = [] if interval is None else [plugin]  # the host's list
            plugin.interval = interval or 1
            start = {clock: fn() for clock, fn in clocks.items()}
            for _ in range(n):
                steps[name] += 1
                float(trainer.train_step(steps[name]))
                if name == guard and steps[name] % b.guard_interval == 0:
                    trainer.snapshot()
            for clock, fn in clocks.items():
                times[clock][name].append(fn() - start[clock])

        for name in variants:  # warm-up (allocations, first measured step, first heatmap)
            block(name, 3)
        for t in times.values():
            for v in t.values():
                v.clear()
        names = list(variants)
        for r in range(b.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                block(name, b.block)
        plugin.close()
        snap_times = []
        for _ in range(5):
            start = time.perf_counter()
            snap = trainer.snapshot()
            snap_times.append(time.perf_counter() - start)
        mb = sum(t.numel() * t.element_size() for t in _tensors(snap)) / 2**20
    print(f"one snapshot: {statistics.median(snap_times) * 1e3:.1f} ms for {mb:.1f} MiB on the host, i.e. "
          f"{statistics.median(snap_times) / b.guard_interval * 1e3:.2f} ms/step at M={b.guard_interval}")
    for clock, t in times.items():
        base = t["none"]
        line = [f"{clock} clock: no plugin {statistics.median(base) / b.block * 1e3:.1f} ms/step"]
        for name, interval in variants.items():
            if name != "none":
                ratio = statistics.median(x / x0 for x, x0 in zip(t[name], base, strict=True))
                per_step = statistics.median(t[name]) / b.block * 1e3
                target = f" (target <= {TARGETS[interval]})" if interval is not None else ""
                line.append(f"{name} {per_step:.1f} ms/step, ratio {ratio:.3f}{target}")
        print(" | ".join(line))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
