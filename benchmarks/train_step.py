"""megapost's training step vs bare PyTorch loops of the same model math and optimizer.

All variants run in this one process on the same synthetic batches, interleaved round by round (the
order rotates) so machine noise hits them alike; every ratio is the median over rounds of the
per-round ratio, on the wall clock and on this process's CPU time.

    python benchmarks/train_step.py                 # fp32: megapost vs a bare fp32 loop
    python benchmarks/train_step.py --bf16          # bf16: megapost vs a bare loop of the same math,
                                                    #   and megapost's bf16 vs fp32 step
    python benchmarks/train_step.py --bf16 --layers 8 --hidden 512 --seq 512 --vocab 32000 --micro 2
    python benchmarks/train_step.py --compile       # also megapost --compile (regional torch.compile of
                                                    #   the blocks) vs megapost eager

The bare bf16 loop does what megapost's bf16 does, in plain PyTorch: bf16 weights and activations
(RMSNorm and the loss in fp32 inside), fp32 master weights stepped by AdamW, and each micro-batch's
bf16 gradient added into an fp32 accumulator as soon as autograd produces it. A bare autocast loop
(fp32 weights, bf16 matmuls, fp32 residual stream) is shown as a second reference. On a CPU shared
with other jobs read the CPU-time line and pass ``--threads 1``: a busy machine makes every
multi-threaded kernel wait for a descheduled worker thread, which swamps what is being measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_common import add_model_args, build_trainer, synthetic_batches

from megapost.config.resolved import OptimizerConfig
from megapost.metrics.peak_flops import measure_matmul_tflops
from megapost.model import LlamaModel, ModelConfig, lm_loss
from megapost.optim.optimizer import build_optimizer

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class BareLoop:
    """A plain PyTorch training step of ``LlamaModel``: ``mode`` is fp32, autocast (fp32 weights,
    bf16 autocast) or bf16 (bf16 weights, fp32 master weights and fp32 gradient accumulation)."""

    def __init__(self, cfg: ModelConfig, opt: OptimizerConfig, clip_grad: float, mode: str, micro: int,
                 accum: int, device: torch.device | None = None) -> None:
        self.mode, self.accum, self.clip = mode, accum, clip_grad
        self.device = device or torch.device("cpu")  # the device megapost trains on: same-device ratios
        self.model = LlamaModel(cfg).to(self.device)
        self.batches: Iterator[dict[str, torch.Tensor]] = synthetic_batches(cfg.vocab_size, micro,
                                                                            cfg.seq_length)
        if mode != "bf16":
            self.params = list(self.model.parameters())
            self.optimizer = build_optimizer(self.model, opt)
            return
        master = LlamaModel(cfg).to(self.device)  # same initial weights, fp32, stepped by the optimizer
        self.master = list(master.parameters())
        self.model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = torch.zeros_like(m)
            p.register_post_accumulate_grad_hook(self._accumulator(m))
        self.optimizer = build_optimizer(master, opt)

    @staticmethod
    def _accumulator(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def add_to_fp32(p: torch.Tensor) -> None:
            assert master.grad is not None and p.grad is not None
            master.grad.add_(p.grad)
            p.grad = None

        return add_to_fp32

    def step(self) -> None:
        for _ in range(self.accum):
            b = {k: v.to(self.device, non_blocking=True) for k, v in next(self.batches).items()}
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mode == "autocast"):
                loss = lm_loss(self.model(b["tokens"]), b["labels"], b["loss_mask"]) / self.accum
            loss.backward()
        if self.mode != "bf16":
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
            torch._foreach_zero_([m.grad for m in self.master])


def run_rounds(variants: dict[str, Callable[[], Any]], rounds: int, peak_dtype: torch.dtype,
               device: torch.device) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Time each variant once per round, rotating the order; also the matmul peak once per round."""
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in variants} for c in CLOCKS}
    peaks = []
    names = list(variants)
    for fn in variants.values():  # warm-up: allocations, compilation, first optimizer step
        fn()
        fn()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = {c: clock() for c, clock in CLOCKS.items()}
            variants[name]()
            if device.type == "cuda":  # the step ends when the device is done
                torch.cuda.synchronize(device)
            for c, clock in CLOCKS.items():
                times[c][name].append(clock() - start[c])
        peaks.append(measure_matmul_tflops(peak_dtype, device))
    return times, peaks


def ratio(t: dict[str, list[float]], a: str, b: str) -> str:
    """Median of the per-round ratios, with their range (the noise)."""
    r = [x / y for x, y in zip(t[a], t[b], strict=True)]
    return f"{statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true", help="also time megapost --compile vs eager")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    b = p.parse_args()
    if b.threads:
        torch.set_num_threads(b.threads)
    precision = ["--bf16"] if b.bf16 else []
    trainer, cfg, _ = build_trainer(b, precision)
    opt, clip = trainer.config.optimizer, trainer.config.engine.clip_grad
    variants: dict[str, Callable[[], Any]] = {"megapost": lambda: float(trainer.train_step(1))}
    pairs: list[tuple[str, str, str]] = []  # (numerator, denominator, what and target)
    if b.bf16:
        bare = BareLoop(cfg, opt, clip, "bf16", b.micro, b.accum, trainer.device)
        autocast = BareLoop(cfg, opt, clip, "autocast", b.micro, b.accum, trainer.device)
        fp32, _, _ = build_trainer(b, [])
        variants.update({"bare bf16": bare.step, "bare autocast": autocast.step,
                         "megapost fp32": lambda: float(fp32.train_step(1))})
        pairs += [("megapost", "bare bf16", "bf16 megapost / bare bf16 (target <= 1.05)"),
                  ("megapost", "bare autocast", "bf16 megapost / bare autocast"),
                  ("megapost fp32", "megapost", "megapost fp32 / bf16 = bf16 speedup (target >= 2.0)"),
                  ("bare autocast", "bare bf16", "bare autocast / bare bf16")]
    else:
        bare = BareLoop(cfg, opt, clip, "fp32", b.micro, b.accum, trainer.device)
        variants["bare fp32"] = bare.step
        pairs.append(("megapost", "bare fp32", "fp32 megapost / bare fp32 (target <= 1.10)"))
    if b.compile:  # warm-up (run_rounds) compiles; all blocks share one graph
        compiled, _, _ = build_trainer(b, [*precision, "--compile"])
        variants["megapost compiled"] = lambda: float(compiled.train_step(1))
        pairs.append(("megapost compiled", "megapost", "megapost --compile / eager"))
    dtype = torch.bfloat16 if b.bf16 else torch.float32
    times, peaks = run_rounds(variants, b.rounds, dtype, trainer.device)

    tokens = b.micro * b.accum * b.seq
    print(f"precision {'bf16' if b.bf16 else 'fp32'} | threads {torch.get_num_threads()} | "
          f"{b.rounds} rounds, medians")
    for clock, t in times.items():
        medians = " | ".join(f"{n} {statistics.median(v) * 1e3:.1f} ms" for n, v in t.items())
        print(f"{clock} clock: {medians}")
    for num, den, what in pairs:
        print(f"{what}: wall {ratio(times['wall'], num, den)} | cpu {ratio(times['cpu'], num, den)}")
    t_ours = statistics.median(times["wall"]["megapost"])
    model_tflops = tokens * cfg.flops_per_token() / t_ours / 1e12
    peak = statistics.median(peaks)
    print(f"megapost model {model_tflops:.3f} TFLOP/s vs measured {dtype} matmul peak {peak:.3f} TFLOP/s | "
          f"fraction {model_tflops / peak:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
