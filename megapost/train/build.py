"""The one build path: a validated run (megapost.train.prepare) -> a ready ``Trainer``: process groups,
run directory, the typed config, data, model, plugins, optimizer and lr schedule, the DeepSpeed config
and engine with megapost's hooks and checkpoint safety, writers and the memory report. Used by
``megapost.pretrain``, ``benchmarks/`` and the tests' layout harness alike."""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import deepspeed
import numpy as np
import torch

from megapost.checkpoint import hf
from megapost.checkpoint import safety as checkpoint_safety
from megapost.checkpoint.folder import last_complete
from megapost.config import launches
from megapost.config.errors import ConfigError
from megapost.config.megatron_habits import init_summary
from megapost.config.resolved import BatchConfig, Config, DataConfig, OptimizerConfig, RuntimeConfig, resolve
from megapost.data import build_data_iterator
from megapost.data.blend import build_datasets
from megapost.ds_adapter.deepspeed_engine import DeepSpeedEngine
from megapost.kernels import triton_check, triton_note
from megapost.kernels.triton_common import runs_on
from megapost.metrics.monitor import Monitor, wandb_settings
from megapost.metrics.peak_flops import resolve_peak
from megapost.metrics.tensor_memory import LiveTensorMemory
from megapost.metrics.throughput import PeakMemory
from megapost.model.config import ModelConfig
from megapost.model.fusion import TRITON_FUSIONS, Fusion, parse_fusion, set_kernel_fusion
from megapost.native import build as native
from megapost.native.engine import NativeEngine
from megapost.optim import hooks as optim_hooks
from megapost.optim.ds_config import build_ds_config
from megapost.optim.grad_reduce import configure_grad_reduction, overlap_bucket
from megapost.optim.optimizer import build_optimizer
from megapost.optim.schedule import WarmupDecaySchedule
from megapost.parallel import (
    build_model,
    deepspeed_config_errors,
    deepspeed_config_overrides,
    initialize_parallel,
    make_mpu,
)
from megapost.parallel.compile import compile_blocks
from megapost.parallel.layers import defer_sequence_parallel_reduction
from megapost.parallel.state import ParallelState
from megapost.plan import planned_rank_peak
from megapost.runtime import interrupts
from megapost.runtime.cpu import bf16_note
from megapost.runtime.distributed import init_distributed, tp_overlap_env
from megapost.runtime.run_dir import resolve_default_run
from megapost.train.manual_gc import manual_gc_plugins
from megapost.train.plugin_services import plugin_contexts
from megapost.train.prepare import Prepared
from megapost.train.trainer import Trainer
from megapost.utils.faults import NO_FAULTS, FaultInjector


@dataclass(frozen=True)
class DataSource:
    """Iterator factories for this rank: ``train(consumed_samples)`` and ``valid()`` (None: no eval)."""

    train: Callable[[int], Iterator[dict[str, Any]]]
    valid: Callable[[], Iterator[dict[str, Any]] | None]


def build_data(data: DataConfig, batch: BatchConfig, model: ModelConfig, pstate: ParallelState,
               faults: FaultInjector = NO_FAULTS) -> DataSource:
    """This rank's data-parallel slice of --data-path's train and valid splits (``model``: its sequence
    length and --seed)."""
    train, valid, _ = build_datasets(data.sources, data.split, seq_length=model.seq_length,
                                     seed=model.seed, sizes=(data.train_samples, data.valid_samples, 0),
                                     cache_dir=data.cache_dir, faults=faults)

    def train_iter(consumed: int) -> Any:
        return build_data_iterator(train, consumed, batch.micro_batch_size, pstate.dp_rank, pstate.dp_size)

    def valid_iter() -> Any:
        if valid is None:
            return None
        return build_data_iterator(valid, 0, batch.micro_batch_size, pstate.dp_rank, pstate.dp_size)

    return DataSource(train_iter, valid_iter)


def build_plugins(classes: Sequence[type], config: Config, pstate: Any, monitor: Monitor) -> list[Any]:
    """The --plugins (and --manual-gc) plugins, each with its context (megapost.train.plugin_services):
    its own typed config, the run, layout, services and writers."""
    contexts = plugin_contexts(classes, config, pstate, monitor.writer)
    plugins = [cls(ctx) for cls, ctx in zip(classes, contexts, strict=True)]
    return plugins + manual_gc_plugins(config.runtime)


def build_schedule(optimizer: torch.optim.Optimizer, opt: OptimizerConfig) -> WarmupDecaySchedule:
    return WarmupDecaySchedule(optimizer, opt.lr, opt.min_lr, opt.lr_warmup_iters, opt.lr_decay_iters,
                               opt.lr_decay_style, wsd_decay_iters=opt.lr_wsd_decay_iters,
                               wsd_style=opt.lr_wsd_decay_style, warmup_init=opt.lr_warmup_init)


def build_engine(config: Config, user_ds: dict[str, Any], model: torch.nn.Module,
                 pstate: ParallelState) -> tuple[Any, dict[str, Any], list[str]]:
    """The DeepSpeed engine of ``model`` with megapost's optimizer, schedule and generated config (from
    ``config.engine`` and the user's JSON; and the start-up notes of the gradient-reduction choice)."""
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_schedule(optimizer, config.optimizer)
    ds_config = build_ds_config(config.engine, user_ds)
    reduce_notes = configure_grad_reduction(ds_config, config.engine, model, pstate.dp_size)
    for key, value in deepspeed_config_overrides(pstate).items():
        ds_config[key] = {**ds_config.get(key, {}), **value}
    errors = deepspeed_config_errors(pstate, ds_config)
    if errors:
        raise ConfigError("; ".join(errors))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        mpu=make_mpu(pstate) if config.parallel.pipeline_model_parallel_size == 1 else None,
    )
    checkpoint_safety.install(engine, trust=config.checkpoint.trust_checkpoint)
    return engine, ds_config, reduce_notes


def kernel_fusion(run: RuntimeConfig) -> Fusion:
    """The model's fused kernels: ``--kernel-fusion`` and ``--no-triton-kernels``."""
    return parse_fusion(run.kernel_fusion, triton=run.triton_kernels)


def checked_fusion(fusion: Fusion, device: torch.device, dtype: torch.dtype, cfg: ModelConfig,
                   tp: int) -> tuple[Fusion, dict[str, str]]:
    """``fusion`` with the fusions whose Triton kernels fail ``triton_check.self_check`` on ``device`` (at
    ``dtype`` and this rank's widths) on their torch paths, and those failures."""
    names = [n for n in TRITON_FUSIONS if fusion.triton_on(n, dtype)]
    if not names or not runs_on(device):
        return fusion, {}
    widths = triton_check.Widths(cfg.hidden_size, cfg.num_attention_heads // tp, max(1, cfg.kv_groups // tp),
                                 cfg.head_dim, cfg.ffn_hidden_size // tp)
    failed = triton_check.self_check(device, names, dtype, widths)
    return dataclasses.replace(fusion, triton_off=frozenset(failed)), failed


def build(prep: Prepared, *, tracker: LiveTensorMemory | None = None, data: DataSource | None = None,
          faults: FaultInjector = NO_FAULTS, progress: interrupts.Progress | None = None) -> Trainer:
    """The Trainer of ``prep`` (``data``: batches other than --data-path's, e.g. a benchmark's;
    ``faults``: a test harness's, none in production; ``progress``: the run's interrupt state, which
    ``megapost.pretrain`` guards the run with; the trainer owns it)."""
    args, model_cfg = prep.args, prep.model
    interrupts.check_master_port()  # right before the process group binds it: after the corpus build
    cuda_note = tp_overlap_env(args.tensor_model_parallel_size, args.async_tensor_model_parallel_allreduce)
    args.start_notes += [cuda_note] if cuda_note else []
    device = init_distributed(args.local_rank, args.distributed_backend, args.distributed_timeout_minutes)
    resolve_default_run(args)  # no --run-name: a new directory, named by rank 0 for all ranks
    config = resolve(args, model_cfg, device.type, prep.plugin_classes)  # below: the typed sections
    log, progress = config.logging, progress or interrupts.Progress()  # what the interrupt line names
    progress.save, progress.run_name, progress.runs_dir = config.checkpoint.save, log.run_name, log.runs_dir
    progress.checkpoint_of = last_complete
    interrupts.forget_port_check()
    par = config.parallel
    pstate = initialize_parallel(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                 par.sequence_parallel)
    pstate.async_tensor_model_parallel_allreduce = par.async_tensor_model_parallel_allreduce
    data = data or build_data(config.data, config.engine.batch, config.model, pstate, faults)
    torch.manual_seed(config.model.seed)  # and python's and numpy's generators, as Megatron-LM seeds
    random.seed(config.model.seed)  # them: a checkpoint's RNG state is then the same in every run
    np.random.seed(config.model.seed)  # of one config (tools/soak.py compares it bit for bit)
    run = config.runtime
    if native.selected(config):  # its own pipeline stages under PP (megapost.native.pipeline)
        model, loss_fn = native.build_native_model(config, pstate)
    else:
        model, loss_fn = build_model(model_cfg, pstate, checkpoint_activations=run.checkpoint_activations,
                                     checkpoint_num_layers=run.checkpoint_num_layers,
                                     z_loss=config.optimizer.z_loss)
    fusion, failed = checked_fusion(kernel_fusion(run), device, torch.bfloat16 if config.engine.bf16
                                    else torch.float32, model_cfg, par.tensor_model_parallel_size)
    set_kernel_fusion(model, fusion)
    if (fusion.names and "ce" in fusion.names and pstate.is_logging_rank
            and (par.tensor_model_parallel_size > 1 or par.pipeline_model_parallel_size > 1)):
        print("--kernel-fusion ce: the unfused head and loss under tensor or pipeline parallelism (the "
              "chunked head + cross-entropy runs at TP 1, PP 1; docs/kernels.md)")
    note = triton_note(device, [n for n in TRITON_FUSIONS if fusion.on(n)], fusion.triton, failed)
    if device.type != "cpu" and note and pstate.is_logging_rank:  # the paths chosen there
        print(note)
    if run.compile:
        compiled = compile_blocks(model)
        if pstate.is_logging_rank:
            print(f"--compile: {compiled} transformer blocks compiled (eager on collapse-measured steps); "
                  f"unmeasured on GPU since the kernel fusions (slower than eager on an H200 before them), "
                  f"not recommended until benchmarks measure it faster (docs/kernels.md)")
    monitor = Monitor(log.tensorboard_dir, enabled=pstate.is_logging_rank,
                      max_queue=log.tensorboard_queue_size, wandb=wandb_settings(log))
    plugins = build_plugins(prep.plugin_classes, config, pstate, monitor)
    for plugin in plugins:
        plugin.on_model_built(model)
    if native.selected(config):  # megapost's distributed optimizer, no DeepSpeed
        engine, ds_config, reduce_notes = _native_engine(config, prep, model, loss_fn, pstate, device)
        schedule = engine.lr_scheduler
    else:
        ds, ds_config, reduce_notes = build_engine(config, prep.user_ds, model, pstate)
        engine = DeepSpeedEngine(ds, loss_fn, pipeline=config.parallel.pipeline_model_parallel_size > 1,
                                 tp_rank=pstate.tp_rank, dp_rank=pstate.dp_rank)
        schedule = ds.lr_scheduler
    peak = resolve_peak(config.logging.peak_tflops, torch.bfloat16 if config.engine.bf16 else torch.float32,
                        device, config.logging.remeasure_peak)
    planned = planned_rank_peak(model_cfg, config.engine.batch, run, pstate, ds_config)
    memory = PeakMemory(device, tracker, planned)
    trainer = Trainer(config, engine, loss_fn, pstate, data.train, data.valid, plugins, monitor,
                      peak.tflops, device, memory=memory, faults=faults, schedule=schedule,
                      progress=progress)
    if isinstance(engine, NativeEngine):
        engine.before_step = trainer.before_optimizer_step
        trainer.logger.skips = engine.skips
        faults.install(engine.module, engine.optimizer)  # a harness's hooks, if any
    else:
        _install_hooks(trainer, engine, config, ds_config, fusion, faults)
    _start(trainer, config, peak.describe(), prep, device, reduce_notes)
    return trainer


def _native_engine(config: Config, prep: Prepared, model: torch.nn.Module, loss_fn: Any,
                   pstate: ParallelState,
                   device: torch.device) -> tuple[NativeEngine, dict[str, Any], list[str]]:
    """--use-distributed-optimizer: the native engine (refused in one line where it does not run yet),
    the DeepSpeed-shaped config the planner's memory reads (ZeRO-1: fp32 shards, full fp32 gradient
    buffer), and its start-up notes."""
    refused = native.refusals(config, prep.user_ds)
    if refused:
        raise ConfigError(refused[0])
    engine = native.build_native(config, model, loss_fn, pstate, device,
                                 lambda optimizer: build_schedule(optimizer, config.optimizer))
    ds_config = build_ds_config(config.engine, {})
    ds_config["zero_optimization"] = {**ds_config.get("zero_optimization", {}), "stage": 1}
    explicit = set(getattr(prep.args, "explicit", ()))
    return engine, ds_config, [native.start_note(engine, config), *native.notes(vars(prep.args), explicit)]


def _install_hooks(trainer: Trainer, engine: DeepSpeedEngine, config: Config, ds_config: dict[str, Any],
                   fusion: Fusion, faults: FaultInjector) -> None:
    """megapost's hooks on DeepSpeed's engine (megapost.optim.hooks) and a harness's fault hooks."""
    ds, run, pstate = engine.ds, config.runtime, trainer.pstate
    defer = pstate.sequence_parallel and DEFER_SP_GAINS  # the gains' partial sums summed once per step
    deferred = defer_sequence_parallel_reduction(ds.module) if defer else []
    skips = optim_hooks.install(ds, trainer.before_optimizer_step, pstate.dp_size,
                                overlap_bucket(ds_config, config.engine),
                                run.max_consecutive_skipped_iterations,
                                fuse_grad_accumulation=fusion.on("grad-accum"),
                                partial_sums=(pstate.tp_group, deferred) if deferred else None)
    trainer.logger.skips = skips  # engine.step() returns its device flag (DeepSpeed's own step: its count)
    engine.skip_flag = None if skips.mode == "deepspeed" else skips.last
    faults.install(ds.module, getattr(ds.optimizer, "optimizer", ds.optimizer))  # a harness's hooks, if any


DEFER_SP_GAINS = True  # benchmarks and tests: False keeps a TP all-reduce per gain per micro-batch

SAVED_BYTES_PER_PARAMETER = {"adam": 12, "sgd": 8}  # fp32 weight + the optimizer's fp32 state


def _untyped_save_note(config: Config, args: argparse.Namespace) -> str | None:
    """No --save typed, the run directory's checkpoints/ used: where, how large and when, once."""
    ckpt = config.checkpoint
    if not (ckpt.save and getattr(args, "save_in_run_dir", False)):
        return None
    size = config.model.num_parameters() * SAVED_BYTES_PER_PARAMETER[config.optimizer.optimizer]
    when = f"every {ckpt.save_interval} iterations and at the end" if ckpt.save_interval else "at the end"
    return (f"no --save typed: checkpoints go to the run directory, {ckpt.save} (~{size / 2**30:.3g} GB "
            f"each: fp32 weights and optimizer state; {when}); pass --save DIR to put them elsewhere")


def _start(trainer: Trainer, config: Config, peak: str, prep: Prepared, device: torch.device,
           notes: list[str]) -> None:
    """Resume, or start from --load-hf's weights; the start-up lines and the run's args.json."""
    ckpt, monitor, pstate, args = config.checkpoint, trainer.monitor, trainer.pstate, prep.args
    if ckpt.load:
        trainer.load()
        engine = trainer.engine
        schedule = engine.scheduler_state()
        if schedule is not None:  # the new schedule's lr from the first step
            engine.load_scheduler_state(schedule)
    elif ckpt.load_hf:
        hf.load_hf_weights(trainer.engine, pstate, ckpt.load_hf)
        monitor.line(f" loaded the weights of {ckpt.load_hf}")
    elif config.logging.run_dir:  # a named run restarted before its first checkpoint: its logs start over
        trainer.continue_logs(-1, -1)
    trainer.checkpoints.start()  # --save seen by every rank; tags beyond the start set aside
    monitor.line(f" megapost: {config.model.parameter_summary()}, norm={config.model.norm_position}, "
                 f"{init_summary(args)}, {'bf16' if config.engine.bf16 else 'fp32'}, {prep.threads}, "
                 f"(TP,PP,DP)=({pstate.tp_size},{pstate.pp_size},{pstate.dp_size}), "
                 f"grad accum {config.engine.batch.grad_accum_steps}, peak {peak}")
    for note in [n for n in (bf16_note(config.engine.bf16, device),) if n]:
        monitor.line(f" megapost: {note}")
    for note in args.start_notes:  # what a Megatron command line means here, and what a resume changed
        monitor.line(f" megapost: {note}")
    if config.optimizer.optimizer == "sgd":
        monitor.line(" megapost: --optimizer sgd: the planned memory counts AdamW's two moments (an upper "
                     "bound)")
    for note in config.logging.megatron_notes:
        monitor.line(f" megapost: accepted {note}")
    for note in notes + [n for n in (_untyped_save_note(config, args),) if n]:
        monitor.line(f" megapost: {note}")
    if pstate.is_logging_rank:  # args.json: the typed sections and the launch history
        launches.write_record(args, [config.logging.tensorboard_dir, ckpt.save], config.to_json())
