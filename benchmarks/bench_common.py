"""What the benchmarks share: model-size flags, synthetic batches, and megapost's real Trainer built
around a DeepSpeed engine in this one process."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

import deepspeed
import torch

from megapost.config.arguments import parse_args, validate_args
from megapost.engine import hooks as engine_hooks
from megapost.engine.ds_config import build_ds_config
from megapost.engine.optimizer import build_optimizer
from megapost.engine.schedule import WarmupDecaySchedule
from megapost.metrics.monitor import Monitor
from megapost.model import ModelConfig
from megapost.parallel import build_model, initialize_parallel
from megapost.parallel.compile import compile_blocks
from megapost.pretrain import build_plugins, model_config_from_args
from megapost.runtime.distributed import init_distributed
from megapost.train.trainer import PluginBatches, Trainer


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)


def synthetic_batches(vocab: int, micro: int, seq: int) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(micro, seq)}


def build_trainer(b: argparse.Namespace, extra_flags: Sequence[str] = (), plugin_classes: Sequence[type] = (),
                  tb_dir: str | None = None) -> tuple[Trainer, ModelConfig, Any]:
    """megapost's Trainer (real engine, hooks and plugins) on synthetic batches; returns it, the
    model config and args."""
    args = parse_args(["--num-layers", str(b.layers), "--hidden-size", str(b.hidden), "--ffn-hidden-size",
                       str(3 * b.hidden), "--seq-length", str(b.seq), "--micro-batch-size", str(b.micro),
                       "--global-batch-size", str(b.micro * b.accum), "--tokenizer-model", __file__,
                       "--data-path", "unused", "--lr", "1e-4", *extra_flags], plugin_classes)
    args.tensorboard_dir = tb_dir
    try:
        validate_args(args, 1)
    except SystemExit as e:  # only the data path is missing: the benchmark uses synthetic batches
        assert "--data-path" in str(e), e
    device = init_distributed(args)
    pstate = initialize_parallel(1, 1, False)
    cfg = model_config_from_args(args, b.vocab)
    model, loss_fn = build_model(cfg, pstate)
    if args.compile:
        compile_blocks(model)
    monitor = Monitor(tb_dir, enabled=tb_dir is not None)
    plugins = build_plugins(plugin_classes, args, cfg, pstate, monitor)
    for plugin in plugins:
        plugin.on_model_built(model)
    opt = build_optimizer(model, args)
    sched = WarmupDecaySchedule(opt, args.lr, 0.0, 0, 10**6, "constant")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                      config=build_ds_config(args, {}))
    trainer = Trainer(args, engine, loss_fn, pstate, None, None, plugins, monitor, cfg.flops_per_token(),
                      1.0, device)
    engine_hooks.install(engine, trainer.before_optimizer_step, pstate.dp_size)
    trainer.batches = PluginBatches(synthetic_batches(cfg.vocab_size, b.micro, b.seq), pipeline=False)
    print(f"model {cfg.num_parameters() / 1e6:.1f}M params, {b.layers}x{b.hidden}, seq {b.seq}, "
          f"batch {b.micro}x{b.accum}, threads {torch.get_num_threads()}")
    return trainer, cfg, args
