"""The resolved, typed configuration: one pure ``resolve(args, model, device_type)`` after parsing and
validation turns the flags (presets applied, Megatron flags mapped, batch arithmetic and run directory
done) into frozen sections, each the input of one part of the build (megapost.train.build); the
Namespace goes no further. ``to_json`` is the run's ``args.json``: every flag by name (flat, as before)
and the sections under ``resolved``."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from megapost.model.config import ModelConfig
from megapost.parallel.reduce_bytes import fewer_bytes_stage


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    sequence_parallel: bool
    data_parallel_size: int
    distributed_backend: str | None
    distributed_timeout_minutes: float


@dataclass(frozen=True)
class DataConfig:
    sources: Any  # megapost.data.blend.DataSources (frozen)
    split: str
    cache_dir: str  # --data-cache-dir, else index-cache/ beside the first --data-path
    tokenizer_type: str
    tokenizer_model: str | None
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    train_samples: int
    valid_samples: int  # 0 without evaluation
    seed: int


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and lr schedule (fields named as their flags: ``build_optimizer`` reads them)."""

    optimizer: str
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    z_loss: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    lr_wsd_decay_iters: int
    lr_wsd_decay_style: str
    lr_warmup_init: float = 0.0  # Megatron's --lr-warmup-init: the lr the warmup starts from


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    load_hf: str | None
    save_interval: int
    trust_checkpoint: bool
    ckpt_format: str
    async_save: bool
    save_retain: int
    save_retain_every: int
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    ckpt_step: int | None = None  # Megatron's --ckpt-step: the tag to load instead of 'latest'


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: str | None
    run_dir: str | None
    runs_dir: str | None
    run_name: str | None
    tensorboard_queue_size: int
    peak_tflops: float
    remeasure_peak: bool
    megatron_notes: tuple[str, ...]
    # Megatron-LM's logging flags (megapost.config.logging_flags), as the logger reads them
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    tensorboard_log_interval: int = 1
    log_learning_rate_to_tensorboard: bool = True
    log_gradient_norm_to_tensorboard: bool = True
    log_batch_size_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """What DeepSpeed's config is generated from (megapost.optim.ds_config, .grad_reduce), as it runs."""

    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    clip_grad: float
    bf16: bool
    zero_stage: int  # as DeepSpeed runs it: --bf16 promotes 0 to 1, an overlapped bf16 reduction of
    # one micro-batch per step 1 to 2 (megapost.parallel.reduce_bytes.fewer_bytes_stage) unless
    # --zero-stage is given
    overlap_grad_reduce: bool  # whether the run overlaps gradient reduction with backward
    grad_reduce_in_bf16: bool
    reduce_notes: tuple[str, ...]  # the start-up notes of these choices


@dataclass(frozen=True)
class RuntimeConfig:
    train_iters: int
    eval_interval: int
    eval_iters: int
    bf16: bool
    checkpoint_activations: bool
    checkpoint_num_layers: int
    compile: bool
    seed: int
    exit_interval: int
    exit_duration_in_mins: float
    exit_signal_handler: bool
    deepspeed_config: str | None
    plugins: str
    iterations_to_skip: tuple[int, ...] = ()  # Megatron-LM's --iterations-to-skip
    max_consecutive_skipped_iterations: int = 10
    kernel_fusion: str = "auto"  # --kernel-fusion (megapost.model.fusion.parse_fusion)


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    engine: EngineConfig
    flags: MappingProxyType  # every parsed flag by dest (plugins' included, zero_stage and
    # overlap_grad_reduce as the engine runs them), read-only

    def to_json(self) -> dict[str, Any]:
        sections = {name: asdict(getattr(self, name)) for name in
                    ("model", "parallel", "data", "optimizer", "checkpoint", "logging", "runtime", "engine")}
        sections["data"]["sources"] = repr(self.data.sources)
        return {**self.flags, "resolved": sections}


def grad_reduction(a: argparse.Namespace, device_type: str) -> tuple[int, bool, tuple[str, ...]]:
    """(ZeRO stage, overlap, start-up notes) of the gradient reduction: ``--overlap-grad-reduce`` /
    ``--no-overlap-grad-reduce`` as given, by default on when more than one data-parallel rank reduces
    over GPUs (on CPU/gloo a collective blocks the rank anyway); megapost.optim.grad_reduce applies it."""
    zero = max(1, a.zero_stage) if a.bf16 else a.zero_stage
    notes: list[str] = []
    if a.grad_reduce_in_bf16:  # Megatron-LM reduces an fp32 parameter's gradient in fp32 whatever it says
        notes.append("--grad-reduce-in-bf16: gradients reduced in bf16 (accumulated in fp32)" if a.bf16
                     else "--grad-reduce-in-bf16 without --bf16: fp32 gradients are reduced in fp32, as in "
                     "Megatron-LM")
    wanted = a.overlap_grad_reduce if a.overlap_grad_reduce is not None else device_type == "cuda"
    overlap = bool(wanted) and a.data_parallel_size > 1
    if a.overlap_grad_reduce and a.data_parallel_size == 1:
        notes.append("--overlap-grad-reduce: one data-parallel rank, no gradient reduction to overlap")
    if overlap and a.pipeline_model_parallel_size > 1:  # DeepSpeed's pipeline engine: ZeRO <= 1,
        # gradients reduced in its own step after the last micro-batch
        notes.append("--overlap-grad-reduce: not under pipeline parallelism (DeepSpeed's pipeline engine "
                     "reduces after the last micro-batch)")
        overlap = False
    if overlap and a.bf16 and zero == 1:
        m = a.grad_accum_steps
        if "zero_stage" not in a.explicit and fewer_bytes_stage(
                a.data_parallel_size, m, True, bool(a.grad_reduce_in_bf16)) == 2:
            zero = 2
            notes.append(f"--overlap-grad-reduce with --bf16, {m} micro-batch per step: ZeRO stage 2, "
                         "overlapped (as many bytes as ZeRO-1's one reduction, gradients partitioned)")
        else:  # megapost.ds_adapter.overlap: Megatron DDP's overlap_grad_reduce on the bf16 optimizer
            notes.append(f"--overlap-grad-reduce with --bf16, {m} micro-batch{'es' if m > 1 else ''} per "
                         "step: ZeRO stage 1, gradients accumulated in fp32 over the step and reduced once, "
                         "each bucket all-reduced asynchronously as soon as its last gradient of the last "
                         "micro-batch is ready (overlapped with the rest of that backward), all waited for "
                         "before the optimizer step")
    if overlap and zero == 0:
        notes.append("--overlap-grad-reduce: ZeRO stage 0 all-reduces after backward; "
                     "use --zero-stage 1 or 2")
        overlap = False
    return zero, overlap, tuple(notes)


def engine_config(a: argparse.Namespace, device_type: str) -> EngineConfig:
    """The engine section of validated flags on a ``device_type`` rank."""
    zero_stage, overlap, reduce_notes = grad_reduction(a, device_type)
    return EngineConfig(a.global_batch_size, a.micro_batch_size, a.grad_accum_steps, a.clip_grad,
                        bool(a.bf16), zero_stage, overlap, bool(a.grad_reduce_in_bf16 and a.bf16),
                        reduce_notes)


def resolve(args: argparse.Namespace, model: ModelConfig, device_type: str) -> Config:
    """The typed configuration of validated ``args`` on a ``device_type`` ("cuda", "cpu") rank (pure:
    reads ``args``, changes nothing)."""
    a = args
    engine = engine_config(a, device_type)
    cache = a.data_cache_dir or os.path.join(os.path.dirname(os.path.abspath(a.data_path)), "index-cache")
    return Config(
        model=model,
        parallel=ParallelConfig(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                a.sequence_parallel, a.data_parallel_size, a.distributed_backend,
                                a.distributed_timeout_minutes),
        data=DataConfig(a.data_sources, a.split, cache, a.tokenizer_type, a.tokenizer_model, a.seq_length,
                        a.micro_batch_size, a.global_batch_size, a.grad_accum_steps,
                        a.train_iters * a.global_batch_size,
                        a.eval_iters * a.global_batch_size if a.eval_interval else 0, a.seed),
        optimizer=OptimizerConfig(a.optimizer, a.lr, a.min_lr, a.weight_decay, a.adam_beta1, a.adam_beta2,
                                  a.adam_eps, a.sgd_momentum, a.clip_grad, a.z_loss, a.lr_warmup_iters,
                                  a.lr_decay_iters, a.lr_decay_style, a.lr_wsd_decay_iters or 0,
                                  a.lr_wsd_decay_style, a.lr_warmup_init),
        checkpoint=CheckpointConfig(a.save, a.load, a.load_hf, a.save_interval, a.trust_checkpoint,
                                    a.ckpt_format, a.async_save, a.save_retain, a.save_retain_every,
                                    a.finetune, a.no_load_optim, a.no_load_rng, a.ckpt_step),
        logging=LoggingConfig(a.log_interval, a.tensorboard_dir, a.run_dir, a.runs_dir, a.run_name,
                              a.tensorboard_queue_size, a.peak_tflops, a.remeasure_peak,
                              tuple(a.megatron_notes), a.log_params_norm, a.log_num_zeros_in_grad,
                              a.tensorboard_log_interval, a.log_learning_rate_to_tensorboard,
                              a.log_gradient_norm_to_tensorboard, a.log_batch_size_to_tensorboard,
                              a.log_world_size_to_tensorboard),
        runtime=RuntimeConfig(a.train_iters, a.eval_interval, a.eval_iters, bool(a.bf16),
                              a.checkpoint_activations, a.checkpoint_num_layers, a.compile, a.seed,
                              a.exit_interval, a.exit_duration_in_mins, a.exit_signal_handler,
                              a.deepspeed_config, a.plugins, tuple(a.iterations_to_skip),
                              a.max_consecutive_skipped_iterations,
                              kernel_fusion=getattr(a, "kernel_fusion", "auto")),
        engine=engine,
        flags=MappingProxyType({**{k: v for k, v in vars(a).items() if k != "explicit"},
                                "zero_stage": engine.zero_stage,
                                "overlap_grad_reduce": engine.overlap_grad_reduce}),
    )
