"""Train the paper-180m shape in bf16 on synthetic batches for ``--steps`` optimizer steps and print
tokens/s, model TFLOP/s, MFU against the device's bf16 dense peak, and peak memory.

    python benchmarks/gpu_run.py [--steps 300 --accum 8 --peak-tflops 989]

megapost's real Trainer and DeepSpeed engine in one process (DP=1); the step loop has no host sync:
the device is synchronised only at the ends of the timed window. ``benchmarks/gpu.sh`` runs this and
the collapse_metrics overhead benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from bench_common import build_trainer

from megapost.metrics.peak_flops import resolve_peak


def device_peak(given: float, device: torch.device) -> tuple[float, str]:
    """--peak-tflops, else megapost's datasheet table by device name, else a measured matmul peak."""
    peak = resolve_peak(given, torch.bfloat16, device)
    return peak.tflops, peak.source


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    b = p.parse_args()
    trainer, cfg, _ = build_trainer(b, ["--bf16", "--init-variance", "paper"])
    device = trainer.device
    for step in range(1, b.warmup + 1):
        trainer.train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for step in range(b.warmup + 1, b.warmup + b.steps + 1):
        loss = trainer.train_step(step)
    final = float(loss)  # the one sync of the timed window
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = b.steps * b.micro * b.accum * b.seq / elapsed
    tflops = tokens_per_s * cfg.flops_per_token() / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        peak, source = device_peak(b.peak_tflops, device)
    else:
        peak, source = b.peak_tflops or 1.0, "cpu"
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"device {name} | {cfg.num_parameters() / 1e6:.1f}M params, {b.layers}x{b.hidden}, seq {b.seq}, "
          f"batch {b.micro}x{b.accum}, bf16 | {b.steps} steps in {elapsed:.1f} s, last loss {final:.3f}")
    print(f"tokens/s {tokens_per_s:.0f} | model TFLOP/s {tflops:.1f} | bf16 dense peak {peak:.0f} "
          f"({source}) | MFU {100 * tflops / peak:.1f}%")
    print(f"peak memory allocated {mem:.2f} GiB")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(main())
