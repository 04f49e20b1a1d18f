"""Cost of the collapse-metrics plugin on the real training step (megapost's Trainer + DeepSpeed engine).

One process, one engine, three variants run in blocks of ``--block`` optimizer steps, rotated round by
round so machine noise hits all alike: no plugin, the plugin at ``--collapse-interval 1`` and at 100
(one measured step per block of 100). The plugin writes its TensorBoard scalars, JSONL and heatmap as in
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

import deepspeed
import torch
from collapse_metrics.plugin import CollapseMetricsPlugin
from train_step import synthetic_batches

from megapost import engine_hooks
from megapost.arguments import parse_args, validate_args
from megapost.distributed import init_distributed
from megapost.ds_config import build_ds_config
from megapost.monitor import Monitor
from megapost.optimizer import build_optimizer
from megapost.parallel import build_model, initialize_parallel
from megapost.plugins import PluginContext
from megapost.pretrain import model_config_from_args
from megapost.schedule import WarmupDecaySchedule
from megapost.training import PluginBatches, Trainer

TARGETS = {1: 1.15, 100: 1.01}


def build_trainer(b: argparse.Namespace, tb_dir: str) -> tuple[Trainer, CollapseMetricsPlugin]:
    args = parse_args(["--num-layers", str(b.layers), "--hidden-size", str(b.hidden), "--ffn-hidden-size",
                       str(3 * b.hidden), "--seq-length", str(b.seq), "--micro-batch-size", str(b.micro),
                       "--global-batch-size", str(b.micro * b.accum), "--tokenizer-model", __file__,
                       "--data-path", "unused", "--lr", "1e-4", "--tensorboard-dir", tb_dir,
                       "--plugins", "collapse_metrics"], [CollapseMetricsPlugin])
    try:
        validate_args(args, 1)
    except SystemExit as e:  # only the data path is missing: the benchmark uses synthetic batches
        assert "--data-path" in str(e), e
    device = init_distributed(args)
    pstate = initialize_parallel(1, 1, False)
    cfg = model_config_from_args(args, b.vocab)
    model, loss_fn = build_model(cfg, pstate)
    monitor = Monitor(tb_dir, enabled=True)
    plugin = CollapseMetricsPlugin(PluginContext(args, cfg, pstate, tb_dir, monitor.writer))
    plugin.on_model_built(model)
    opt = build_optimizer(model, args)
    sched = WarmupDecaySchedule(opt, args.lr, 0.0, 0, 10**6, "constant")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                      config=build_ds_config(args, {}))
    trainer = Trainer(args, engine, loss_fn, pstate, None, None, [plugin], monitor, cfg.flops_per_token(),
                      1.0, device)
    engine_hooks.install(engine, trainer.before_optimizer_step)
    trainer.batches = PluginBatches(synthetic_batches(cfg.vocab_size, b.micro, b.seq), pipeline=False)
    print(f"model {cfg.num_parameters() / 1e6:.1f}M params, {b.layers}x{b.hidden}, seq {b.seq}, "
          f"batch {b.micro}x{b.accum}, threads {torch.get_num_threads()}")
    return trainer, plugin


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=100, help="optimizer steps per timed block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    b = p.parse_args()
    if b.threads:
        torch.set_num_threads(b.threads)
    with tempfile.TemporaryDirectory(prefix="collapse-overhead-") as tb_dir:
        trainer, plugin = build_trainer(b, tb_dir)
        variants = {"none": None, "interval 1": 1, "interval 100": 100}
        steps = dict.fromkeys(variants, 0)
        clocks = {"wall": time.perf_counter, "cpu": time.process_time}
        times = {clock: {name: [] for name in variants} for clock in clocks}

        def block(name: str, n: int) -> None:
            interval = variants[name]
            trainer.plugins = [] if interval is None else [plugin]
            plugin.interval = interval or 1
            start = {clock: fn() for clock, fn in clocks.items()}
            for _ in range(n):
                steps[name] += 1
                float(trainer.train_step(steps[name]))
            for clock, fn in clocks.items():
                times[clock][name].append(fn() - start[clock])

        for name in variants:  # warm-up (allocations, first measured step, first heatmap)
            block(name, 3)
        for t in times.values():
            for v in t.values():
                v.clear()
        names = list(variants)
        for r in range(b.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                block(name, b.block)
        plugin.close()
    for clock, t in times.items():
        base = t["none"]
        line = [f"{clock} clock: no plugin {statistics.median(base) / b.block * 1e3:.1f} ms/step"]
        for name, interval in variants.items():
            if interval is not None:
                ratio = statistics.median(x / x0 for x, x0 in zip(t[name], base, strict=True))
                per_step = statistics.median(t[name]) / b.block * 1e3
                target = TARGETS[interval]
                line.append(f"{name} {per_step:.1f} ms/step, ratio {ratio:.3f} (target <= {target})")
        print(" | ".join(line))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
