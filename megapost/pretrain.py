"""``megapost-pretrain`` / ``python -m megapost.pretrain``: build everything from flags and train."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import deepspeed
import numpy as np
import torch

from megapost.checkpoint import hf
from megapost.checkpoint import safety as checkpoint_safety
from megapost.checkpoint.io import check_layout, check_save_dir
from megapost.config import launches
from megapost.config.arguments import parse_args, validate_args
from megapost.config.errors import ConfigError
from megapost.config.megatron_habits import init_summary
from megapost.data import (
    DataError,
    IndexedDataset,
    build_data_iterator,
)
from megapost.data.blend import build_datasets
from megapost.data.tokenizer import build_tokenizer
from megapost.data.tokenizer_sidecar import check_tokenizer_sidecar
from megapost.engine import hooks as engine_hooks
from megapost.engine.ds_config import build_ds_config, reconcile_with_user_config
from megapost.engine.optimizer import build_optimizer
from megapost.engine.schedule import WarmupDecaySchedule
from megapost.metrics.monitor import Monitor
from megapost.metrics.peak_flops import resolve_peak
from megapost.metrics.tensor_memory import LiveTensorMemory, tensor_memory_from_env
from megapost.metrics.throughput import PeakMemory
from megapost.model import ModelConfig
from megapost.parallel import (
    build_model,
    deepspeed_config_errors,
    deepspeed_config_overrides,
    initialize_parallel,
    layout_errors,
    make_mpu,
    padded_vocab_size,
)
from megapost.parallel.compile import compile_blocks
from megapost.plan import planned_rank_peak
from megapost.plugin_api import PluginContext, plugin_classes
from megapost.runtime import interrupts
from megapost.runtime.cpu import bf16_note, set_threads
from megapost.runtime.distributed import init_distributed, world_size_from_env
from megapost.runtime.hang_report import CollectiveFailure
from megapost.runtime.launcher_report import record_for_launcher
from megapost.runtime.run_dir import apply_named_run, resolve_default_run
from megapost.train.manual_gc import manual_gc_plugins
from megapost.train.trainer import Trainer


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=(hf.vocab_for(args, vocab_size)
                    or padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by)),
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
        norm_position=args.norm_position, mix_post_fraction=args.mix_post_fraction,
        dyt_alpha_init=tuple(args.dyt_alpha_init), qk_norm=args.qk_norm,
        norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        init_variance=args.init_variance, init_method_std=args.init_method_std,
        scaled_output_init=args.scaled_output_init, sublayer_init_multiplier=args.init_sublayer_multiplier,
        prefix_alpha=args.prefix_alpha, seed=args.seed,
    )


def check_data(args: argparse.Namespace, tokenizer: Any) -> None:
    """Every source must have been tokenized with this tokenizer (its sidecar says so, see
    data/tokenizer_sidecar.py) or, without a sidecar, with a vocabulary this tokenizer covers."""
    say = print if os.environ.get("RANK", "0") == "0" else (lambda _line: None)  # once, not per rank
    for prefix in args.data_sources.prefixes:
        indexed = IndexedDataset(prefix)
        check_tokenizer_sidecar(prefix, tokenizer, len(indexed), indexed.num_tokens,
                                args.allow_tokenizer_mismatch, say)
        head = np.asarray(indexed.get(0, 0, min(int(indexed.sequence_lengths[0]), 1 << 20)))
        sample = [head] + [np.asarray(indexed[i]) for i in range(1, min(len(indexed), 64))]
        top = max(int(s.max()) for s in sample if s.size)
        if top >= tokenizer.vocab_size:
            raise ConfigError(
                f"--data-path {prefix} holds token id {top} but --tokenizer-model "
                f"{args.tokenizer_model} has only {tokenizer.vocab_size} tokens; re-tokenize the data with "
                "this tokenizer or pass the tokenizer it was built with"
            )


def build_data(args: argparse.Namespace, pstate: Any) -> tuple[Any, Any]:
    """Iterator factories for this rank's data-parallel slice: train(consumed) and valid()."""
    train_samples = args.train_iters * args.global_batch_size
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_interval else 0
    data_dir = os.path.dirname(os.path.abspath(args.data_path))
    cache = args.data_cache_dir or os.path.join(data_dir, "index-cache")
    train, valid, _ = build_datasets(args.data_sources, args.split, seq_length=args.seq_length,
                                     seed=args.seed, sizes=(train_samples, valid_samples, 0), cache_dir=cache)

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
    """Parse, validate, build and train; returns the loss history (used by tests). With
    ``MEGAPOST_TENSOR_MEMORY=1`` every tensor allocation is counted (``LiveTensorMemory``) so the first
    log line shows the measured peak beside the planner's prediction (slower; for CPU checks)."""
    with tensor_memory_from_env() as tracker:
        return _run(argv, tracker)


def _run(argv: Sequence[str], tracker: LiveTensorMemory | None) -> dict[str, Any]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins", default="")
    classes = plugin_classes(pre.parse_known_args(argv)[0].plugins)
    args = parse_args(argv, classes)
    threads = set_threads()  # before any heavy work: cores / local ranks unless OMP_NUM_THREADS
    apply_named_run(args)  # --run-name: runs/<name>/..., resumed when it holds a checkpoint
    args.start_notes += [n for n in (launches.fresh_start(args),) if n] + launches.reconcile_resume(args)
    user_ds = reconcile_with_user_config(args)
    world_size = world_size_from_env()
    validate_args(args, world_size)
    if args.load_hf:  # the model flags come from its config.json
        hf.apply_hf_flags(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    check_data(args, tokenizer)
    try:
        model_cfg = model_config_from_args(args, tokenizer.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    args.padded_vocab_size = model_cfg.vocab_size
    # every rank stops alike here, before any process group forms: a bad layout, or a checkpoint of
    # another layout or model, or unreadable/unsafe checkpoint files
    errors = layout_errors(model_cfg, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.sequence_parallel, args.seq_length, world_size)
    if errors:
        raise ConfigError("invalid parallel layout: " + "; ".join(errors))
    if args.load:
        check_layout(args)
    check_save_dir(args)

    interrupts.check_master_port()  # right before the process group binds it: after the corpus build
    device = init_distributed(args)
    resolve_default_run(args)  # no --run-name: a new directory, named by rank 0 for all ranks
    interrupts.PROGRESS.args = args
    interrupts.forget_port_check()
    pstate = initialize_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 args.sequence_parallel)
    train_iter, valid_iter = build_data(args, pstate)
    torch.manual_seed(args.seed)

    model, loss_fn = build_model(model_cfg, pstate, checkpoint_activations=args.checkpoint_activations,
                                 checkpoint_num_layers=args.checkpoint_num_layers, z_loss=args.z_loss)
    if args.compile:
        compiled = compile_blocks(model)
        if pstate.is_logging_rank:
            print(f"--compile: {compiled} transformer blocks compiled (eager on collapse-measured steps)")
    monitor = Monitor(args.tensorboard_dir, enabled=pstate.is_logging_rank,
                      max_queue=args.tensorboard_queue_size)
    plugins = build_plugins(classes, args, model_cfg, pstate, monitor)
    plugins += manual_gc_plugins(args, model_cfg, pstate)
    for plugin in plugins:
        plugin.on_model_built(model)
    optimizer = build_optimizer(model, args)
    scheduler = WarmupDecaySchedule(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                                    args.lr_decay_iters, args.lr_decay_style,
                                    wsd_decay_iters=args.lr_wsd_decay_iters or 0,
                                    wsd_style=args.lr_wsd_decay_style)
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
    checkpoint_safety.install(engine, trust=args.trust_checkpoint)
    peak = resolve_peak(args.peak_tflops, torch.bfloat16 if args.bf16 else torch.float32, device,
                        args.remeasure_peak)
    trainer = Trainer(args, engine, loss_fn, pstate, train_iter, valid_iter, plugins, monitor,
                      model_cfg.flops_per_token(), peak.tflops, device)
    trainer.memory = PeakMemory(device, tracker, planned_rank_peak(model_cfg, args, pstate, ds_config))
    interrupts.PROGRESS.state = trainer.state
    engine_hooks.install(engine, trainer.before_optimizer_step, pstate.dp_size)
    if args.load:
        trainer.load()
        scheduler.load_state_dict(scheduler.state_dict())  # the new schedule's lr from the first step
    elif args.load_hf:
        hf.load_hf_weights(engine, pstate, args.load_hf)
        monitor.line(f" loaded the weights of {args.load_hf}")
    elif args.run_dir:  # a named run restarted before its first checkpoint: its logs start over
        trainer.continue_logs(-1, -1)
    monitor.line(f" megapost: {model_cfg.parameter_summary()}, norm={args.norm_position}, "
                 f"{init_summary(args)}, {'bf16' if args.bf16 else 'fp32'}, {threads}, "
                 f"(TP,PP,DP)=({pstate.tp_size},{pstate.pp_size},{pstate.dp_size}), "
                 f"grad accum {args.grad_accum_steps}, peak {peak.describe()}")
    for note in [n for n in (bf16_note(args.bf16, device),) if n]:
        monitor.line(f" megapost: {note}")
    for note in args.start_notes:  # what a Megatron command line means here, and what a resume changed
        monitor.line(f" megapost: {note}")
    for note in args.megatron_notes:
        monitor.line(f" megapost: accepted {note}")
    if pstate.is_logging_rank:
        launches.write_record(args, [args.tensorboard_dir, args.save])
    try:
        history = trainer.train()
    finally:
        for plugin in plugins:
            plugin.close()
        monitor.close()
    return history


QUIET_RANK_WAIT_S = 20.0  # how long a rank other than 0 waits for the launcher to stop it


def exit_once(message: str) -> None:
    """Exit 1 with ``message``, printed once per job: rank 0 prints at once; another rank (which under
    the ``deepspeed`` launcher is stopped as soon as rank 0 exits with the same error) waits first and
    prints only if it is still running, i.e. when the error was its own."""
    record_for_launcher(message)  # torchrun's failure report names it (runtime/launcher_report.py)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(QUIET_RANK_WAIT_S)
    raise SystemExit(message)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        interrupts.run_guarded(lambda: run(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:  # bad flags or checkpoint files: one line, exit 1
        exit_once(str(e.code))
    except (DataError, FloatingPointError, CollectiveFailure) as e:  # bad data, a non-finite state, a
        # hung or dead rank: one line, exit 1
        exit_once(f"error: {e}")


if __name__ == "__main__":
    main()
