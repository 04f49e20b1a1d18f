"""megapost's training step vs a bare PyTorch loop of the same model math and optimizer.

Both run in this one process on the same synthetic batches, interleaved round by round so machine
noise hits both alike. Prints the step-time ratio (target <= 1.10) and the model FLOP/s against the
machine's measured matmul FLOP/s. With ``--compile``: megapost's step with ``--compile`` (regional
torch.compile of the blocks) vs megapost's eager step, the same way, and the compiled/eager ratio.

    python benchmarks/train_step.py [--bf16] [--compile] [--layers 4 --hidden 256 --seq 256 --micro 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

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


def interleaved(first: Callable[[], object], second: Callable[[], object], rounds: int,
                ) -> tuple[list[float], list[float]]:
    """Step times of ``first`` and ``second``, alternating which goes first each round."""
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            (first, second)[i]()
            times[i].append(time.perf_counter() - start)
    return times


def compile_ratio(b: argparse.Namespace) -> None:
    """megapost --compile vs megapost eager, same flags, one process, interleaved."""
    flags = ["--bf16"] if b.bf16 else []
    eager, _, _ = build_trainer(b, flags)
    compiled, _, _ = build_trainer(b, [*flags, "--compile"])
    start = time.perf_counter()
    for _ in range(3):  # warm-up; the first compiled steps compile the block
        compiled.train_step(1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # all blocks share one graph
    print(f"compile warm-up (3 steps) {time.perf_counter() - start:.1f} s, {graphs} compiled graph(s)")
    eager.train_step(1)
    t_compiled, t_eager = interleaved(lambda: float(compiled.train_step(1)),
                                      lambda: float(eager.train_step(1)), b.rounds)
    tc, te = statistics.median(t_compiled), statistics.median(t_eager)
    print(f"precision {'bf16' if b.bf16 else 'fp32'}")
    print(f"compiled step {tc * 1e3:.1f} ms | eager step {te * 1e3:.1f} ms | "
          f"ratio compiled/eager {tc / te:.3f} (speedup {te / tc:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true", help="compiled vs eager megapost step instead")
    b = p.parse_args()
    if b.compile:
        return compile_ratio(b)
    trainer, cfg, args = build_trainer(b, ["--bf16"] if b.bf16 else [])
    device = trainer.device

    dtype = torch.bfloat16 if b.bf16 else torch.float32
    bare = LlamaModel(cfg)
    bare_opt = build_optimizer(bare, args)
    bare_batches = synthetic_batches(cfg.vocab_size, b.micro, b.seq)

    def bare_once() -> None:
        bare_step(bare, bare_opt, bare_batches, b.accum, args.clip_grad, dtype)

    for _ in range(2):  # warm-up
        trainer.train_step(1)
        bare_once()
    ours, theirs = interleaved(lambda: float(trainer.train_step(1)), bare_once, b.rounds)
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
