"""megapost's training step vs a bare PyTorch loop of the same model math and optimizer.

Both run in this one process on the same synthetic batches, interleaved round by round so machine
noise hits both alike. Prints the step-time ratio (target <= 1.10) and the model FLOP/s against the
machine's measured matmul FLOP/s.

    python benchmarks/train_step.py [--bf16] [--layers 4 --hidden 256 --seq 256 --micro 4 --accum 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_common import add_model_args, build_trainer, synthetic_batches

from megapost.model import LlamaModel, lm_loss
from megapost.optimizer import build_optimizer
from megapost.peak_flops import measure_matmul_tflops


def bare_step(model, optimizer, batches, accum: int, clip: float, dtype: torch.dtype) -> None:
    for _ in range(accum):
        b = next(batches)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = lm_loss(model(b["tokens"]), b["labels"], b["loss_mask"]) / accum
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--bf16", action="store_true")
    b = p.parse_args()
    trainer, cfg, args = build_trainer(b, ["--bf16"] if b.bf16 else [])
    device = trainer.device

    dtype = torch.bfloat16 if b.bf16 else torch.float32
    bare = LlamaModel(cfg)
    bare_opt = build_optimizer(bare, args)
    bare_batches = synthetic_batches(cfg.vocab_size, b.micro, b.seq)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        trainer.train_step(1)
        bare_step(bare, bare_opt, bare_batches, b.accum, args.clip_grad, dtype)
    ours, theirs = [], []
    for r in range(b.rounds):
        first, second = (ours, theirs) if r % 2 == 0 else (theirs, ours)
        for times in (first, second):
            if times is ours:
                times.append(timed(lambda: float(trainer.train_step(1))))
            else:
                times.append(timed(lambda: bare_step(bare, bare_opt, bare_batches, b.accum, args.clip_grad,
                                                     dtype)))
    t_ours, t_bare = statistics.median(ours), statistics.median(theirs)
    tokens = b.micro * b.accum * b.seq
    model_tflops = tokens * cfg.flops_per_token() / t_ours / 1e12
    peak = measure_matmul_tflops(dtype, device)
    print(f"precision {'bf16' if b.bf16 else 'fp32'}")
    print(f"megapost step {t_ours * 1e3:.1f} ms | bare PyTorch step {t_bare * 1e3:.1f} ms | "
          f"ratio {t_ours / t_bare:.3f} (target <= 1.10)")
    print(f"model {model_tflops:.3f} TFLOP/s vs measured matmul peak {peak:.3f} TFLOP/s | "
          f"ratio {model_tflops / peak:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
