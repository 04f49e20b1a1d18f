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

import deepspeed
import torch

from megapost.arguments import parse_args, validate_args
from megapost.distributed import init_distributed
from megapost.ds_config import build_ds_config
from megapost.model import LlamaModel, lm_loss
from megapost.monitor import Monitor
from megapost.optimizer import build_optimizer
from megapost.parallel import build_model, initialize_parallel
from megapost.pretrain import model_config_from_args
from megapost.schedule import WarmupDecaySchedule
from megapost.throughput import measure_matmul_tflops
from megapost.training import PluginBatches, Trainer


def synthetic_batches(vocab: int, micro: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(micro, seq)}


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
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--bf16", action="store_true")
    b = p.parse_args()
    args = parse_args(["--num-layers", str(b.layers), "--hidden-size", str(b.hidden), "--ffn-hidden-size",
                       str(3 * b.hidden), "--seq-length", str(b.seq), "--micro-batch-size", str(b.micro),
                       "--global-batch-size", str(b.micro * b.accum), "--tokenizer-model", __file__,
                       "--data-path", "unused", "--lr", "1e-4"] + (["--bf16"] if b.bf16 else []))
    try:
        validate_args(args, 1)
    except SystemExit as e:  # only the data path is missing: the benchmark uses synthetic batches
        assert "--data-path" in str(e), e
    device = init_distributed(args)
    pstate = initialize_parallel(1, 1, False)
    cfg = model_config_from_args(args, b.vocab)

    model, loss_fn = build_model(cfg, pstate)
    opt = build_optimizer(model, args)
    sched = WarmupDecaySchedule(opt, args.lr, 0.0, 0, 10**6, "constant")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                      config=build_ds_config(args, {}))
    trainer = Trainer(args, engine, loss_fn, pstate, None, None, [], Monitor(None, False),
                      cfg.flops_per_token(), 1.0, device)
    trainer.batches = PluginBatches(synthetic_batches(cfg.vocab_size, b.micro, b.seq), pipeline=False)

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
    print(f"model {cfg.num_parameters() / 1e6:.1f}M params, {b.layers}x{b.hidden}, seq {b.seq}, "
          f"batch {b.micro}x{b.accum}, {'bf16' if b.bf16 else 'fp32'}, threads {torch.get_num_threads()}")
    print(f"megapost step {t_ours * 1e3:.1f} ms | bare PyTorch step {t_bare * 1e3:.1f} ms | "
          f"ratio {t_ours / t_bare:.3f} (target <= 1.10)")
    print(f"model {model_tflops:.3f} TFLOP/s vs measured matmul peak {peak:.3f} TFLOP/s | "
          f"ratio {model_tflops / peak:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
