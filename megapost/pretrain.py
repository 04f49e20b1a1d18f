"""``megapost-pretrain`` / ``python -m megapost.pretrain``: build everything from flags and train."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import deepspeed
import numpy as np
import torch

from . import engine_hooks
from .arguments import ConfigError, parse_args, validate_args
from .checkpoint_io import check_layout
from .data import (
    DataError,
    IndexedDataset,
    SentencePieceTokenizer,
    build_data_iterator,
    build_train_valid_test_datasets,
)
from .distributed import init_distributed, world_size_from_env
from .ds_config_builder import build_ds_config, reconcile_with_user_config
from .model import ModelConfig
from .monitor import Monitor
from .optimizer import build_optimizer
from .parallel import (
    build_model,
    deepspeed_config_errors,
    deepspeed_config_overrides,
    initialize_parallel,
    make_mpu,
    padded_vocab_size,
    validate_layout,
)
from .plugins import PluginContext, plugin_classes
from .schedule import WarmupDecaySchedule
from .throughput import measure_matmul_tflops
from .training import Trainer
from .utils.atomic import atomic_path


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by),
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        norm_position=args.norm_position, norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        init_variance=args.init_variance, init_method_std=args.init_method_std,
        scaled_output_init=args.scaled_output_init, sublayer_init_multiplier=args.init_sublayer_multiplier,
        prefix_alpha=args.prefix_alpha, seed=args.seed,
    )


def check_data(args: argparse.Namespace, tokenizer: SentencePieceTokenizer) -> IndexedDataset:
    """The dataset must have been tokenized with a vocabulary this tokenizer covers."""
    indexed = IndexedDataset(args.data_path)
    head = np.asarray(indexed.get(0, 0, min(int(indexed.sequence_lengths[0]), 1 << 20)))
    sample = [head] + [np.asarray(indexed[i]) for i in range(1, min(len(indexed), 64))]
    top = max(int(s.max()) for s in sample if s.size)
    if top >= tokenizer.vocab_size:
        raise ConfigError(
            f"--data-path {args.data_path} holds token id {top} but --tokenizer-model "
            f"{args.tokenizer_model} has only {tokenizer.vocab_size} tokens; re-tokenize the data with "
            "this tokenizer or pass the tokenizer it was built with"
        )
    return indexed


def build_data(args: argparse.Namespace, pstate: Any) -> tuple[Any, Any]:
    """Iterator factories for this rank's data-parallel slice: train(consumed) and valid()."""
    train_samples = args.train_iters * args.global_batch_size
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_interval else 0
    data_dir = os.path.dirname(os.path.abspath(args.data_path))
    cache = args.data_cache_dir or os.path.join(data_dir, "index-cache")
    train, valid, _ = build_train_valid_test_datasets(
        args.data_path, args.split, seq_length=args.seq_length, seed=args.seed,
        train_valid_test_num_samples=(train_samples, valid_samples, 0), cache_dir=cache)

    def train_iter(consumed: int) -> Any:
        return build_data_iterator(train, consumed, args.micro_batch_size, pstate.dp_rank, pstate.dp_size)

    def valid_iter() -> Any:
        if valid is None:
            return None
        return build_data_iterator(valid, 0, args.micro_batch_size, pstate.dp_rank, pstate.dp_size)

    return train_iter, valid_iter


def build_plugins(classes: Sequence[type], args: argparse.Namespace, model_cfg: ModelConfig, pstate: Any,
                  monitor: Monitor) -> list[Any]:
    ctx = PluginContext(args=args, model_config=model_cfg, parallel=pstate,
                        tensorboard_dir=args.tensorboard_dir, writer=monitor.writer)
    return [cls(ctx) for cls in classes]


def run(argv: Sequence[str]) -> dict[str, Any]:
    """Parse, validate, build and train; returns the loss history (used by tests)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins", default="")
    classes = plugin_classes(pre.parse_known_args(argv)[0].plugins)
    args = parse_args(argv, classes)
    user_ds = reconcile_with_user_config(args)
    validate_args(args, world_size_from_env())
    if args.load:  # a checkpoint of another TP/PP layout: every rank stops here, before any group forms
        check_layout(args)
    tokenizer = SentencePieceTokenizer(args.tokenizer_model)
    check_data(args, tokenizer)

    device = init_distributed(args)
    pstate = initialize_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 args.sequence_parallel)
    model_cfg = model_config_from_args(args, tokenizer.vocab_size)
    validate_layout(model_cfg, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    args.sequence_parallel, args.seq_length, pstate.world_size)
    train_iter, valid_iter = build_data(args, pstate)
    torch.manual_seed(args.seed)

    model, loss_fn = build_model(model_cfg, pstate, checkpoint_activations=args.checkpoint_activations,
                                 checkpoint_num_layers=args.checkpoint_num_layers)
    monitor = Monitor(args.tensorboard_dir, enabled=pstate.is_logging_rank)
    plugins = build_plugins(classes, args, model_cfg, pstate, monitor)
    for plugin in plugins:
        plugin.on_model_built(model)
    optimizer = build_optimizer(model, args)
    scheduler = WarmupDecaySchedule(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                                    args.lr_decay_iters, args.lr_decay_style)
    ds_config = build_ds_config(args, user_ds)
    for key, value in deepspeed_config_overrides(pstate).items():
        ds_config[key] = {**ds_config.get(key, {}), **value}
    errors = deepspeed_config_errors(pstate, ds_config)
    if errors:
        raise ConfigError("; ".join(errors))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        mpu=make_mpu(pstate) if args.pipeline_model_parallel_size == 1 else None,
    )
    peak = args.peak_tflops or measure_matmul_tflops(torch.bfloat16 if args.bf16 else torch.float32, device)
    trainer = Trainer(args, engine, loss_fn, pstate, train_iter, valid_iter, plugins, monitor,
                      model_cfg.flops_per_token(), peak, device)
    engine_hooks.install(engine, trainer.before_optimizer_step, pstate.dp_size)
    if args.load:
        trainer.load()
    monitor.line(f" megapost: {model_cfg.num_parameters() / 1e6:.2f}M parameters, norm={args.norm_position}, "
                 f"(TP,PP,DP)=({pstate.tp_size},{pstate.pp_size},{pstate.dp_size}), "
                 f"grad accum {args.grad_accum_steps}, peak {peak:.2f} TFLOP/s/device")
    if pstate.is_logging_rank and args.tensorboard_dir:
        with atomic_path(os.path.join(args.tensorboard_dir, "args.json")) as tmp, open(tmp, "w") as f:
            json.dump({k: v for k, v in vars(args).items() if k != "explicit"}, f, indent=1, default=str)
    try:
        history = trainer.train()
    finally:
        for plugin in plugins:
            plugin.close()
        monitor.close()
    return history


def main(argv: Sequence[str] | None = None) -> None:
    try:
        run(sys.argv[1:] if argv is None else argv)
    except (DataError, FloatingPointError) as e:  # bad data or a non-finite loss: one line, exit 1
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
