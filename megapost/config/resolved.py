"""The resolved, typed configuration: one pure ``resolve(args, model, device_type)`` after parsing and
validation turns the flags (presets applied, Megatron flags mapped, batch arithmetic and run directory
done) into frozen sections, each the input of one part of the build (megapost.train.build); the
Namespace goes no further. Every field lives in exactly one section ("where is the config of X": here);
a plugin's own flags are its own typed section (``Config.plugins``). ``to_json`` is the run's
``args.json`` (megapost.config.launches), the sections' serialisation."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
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
    async_tensor_model_parallel_allreduce: bool = True  # --no-async-tensor-model-parallel-allreduce
    virtual_pipeline_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage (native engine)

    def virtual_stages(self, num_layers: int) -> int:
        """Chunks per pipeline rank: L / (PP x layers per virtual stage), 1 without the flag."""
        n = self.virtual_pipeline_layers
        return num_layers // (self.pipeline_model_parallel_size * n) if n else 1


@dataclass(frozen=True)
class BatchConfig:
    """The batch arithmetic of one optimizer step (per data-parallel rank: ``micro_batch_size``)."""

    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int


@dataclass(frozen=True)
class DataConfig:
    """The corpus and its splits (the sequence length and --seed: ``ModelConfig``'s)."""

    sources: Any  # megapost.data.blend.DataSources (frozen)
    split: str
    cache_dir: str  # --data-cache-dir, else index-cache/ beside the first --data-path
    tokenizer_type: str
    tokenizer_model: str | None
    train_samples: int
    valid_samples: int  # 0 without evaluation


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
    wandb_project: str | None = None  # Weights & Biases (megapost.metrics.monitor), when wandb is installed
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    """What DeepSpeed's config is generated from (megapost.optim.ds_config, .grad_reduce), as it runs:
    the step's batch, precision, clipping and gradient reduction."""

    batch: BatchConfig
    clip_grad: float
    bf16: bool
    zero_stage: int  # as DeepSpeed runs it: --bf16 promotes 0 to 1, an overlapped bf16 reduction of
    # one micro-batch per step 1 to 2 (megapost.parallel.reduce_bytes.fewer_bytes_stage) unless
    # --zero-stage is given
    overlap_grad_reduce: bool  # whether the run overlaps gradient reduction with backward
    grad_reduce_in_bf16: bool
    reduce_notes: tuple[str, ...]  # the start-up notes of these choices
    distributed_optimizer: bool = False  # --use-distributed-optimizer: megapost.native's engine


@dataclass(frozen=True)
class RuntimeConfig:
    train_iters: int
    eval_interval: int
    eval_iters: int
    checkpoint_activations: bool
    checkpoint_num_layers: int
    compile: bool
    exit_interval: int
    exit_duration_in_mins: float
    exit_signal_handler: bool
    deepspeed_config: str | None
    iterations_to_skip: tuple[int, ...] = ()  # Megatron-LM's --iterations-to-skip
    max_consecutive_skipped_iterations: int = 10
    kernel_fusion: str = "auto"  # --kernel-fusion (megapost.model.fusion.parse_fusion)
    triton_kernels: bool = True  # --no-triton-kernels: False
    manual_gc: bool = False  # Megatron's --manual-gc (megapost.train.manual_gc)
    manual_gc_interval: int = 0


SECTIONS = ("model", "parallel", "data", "optimizer", "checkpoint", "logging", "runtime", "engine")


@dataclass(frozen=True)
class Config:
    """The run's configuration: each field in exactly one section; ``plugins``: each --plugins plugin's
    own typed config by plugin name (its ``config_class``, parsed from its own flags)."""

    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    engine: EngineConfig
    plugins: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def to_json(self) -> dict[str, Any]:
        """``args.json``'s sections (megapost.config.launches): each section's fields by name, the
        plugins' configs under ``plugins``."""
        sections: dict[str, Any] = {name: asdict(getattr(self, name)) for name in SECTIONS}
        sections["data"]["sources"] = repr(self.data.sources)
        sections["plugins"] = {name: asdict(cfg) if cfg is not None else None  # None: no config_class
                               for name, cfg in self.plugins.items()}
        return sections


def plugin_config(cls: type, args: argparse.Namespace) -> Any:
    """A plugin's typed config: its ``config_class`` (a dataclass whose fields are the dests of the flags
    its ``add_arguments`` registers) from the parsed flags; None for a plugin without one."""
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        return None
    return config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})


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
    native = bool(getattr(a, "use_distributed_optimizer", False))
    if overlap and a.pipeline_model_parallel_size > 1 and not native:  # DeepSpeed's pipeline engine:
        # ZeRO <= 1, gradients reduced in its own step after the last micro-batch
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
    return EngineConfig(
        batch=BatchConfig(micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
                          grad_accum_steps=a.grad_accum_steps),
        clip_grad=a.clip_grad, bf16=bool(a.bf16), zero_stage=zero_stage, overlap_grad_reduce=overlap,
        grad_reduce_in_bf16=bool(a.grad_reduce_in_bf16 and a.bf16), reduce_notes=reduce_notes,
        distributed_optimizer=bool(getattr(a, "use_distributed_optimizer", False)))


def _data(a: argparse.Namespace) -> DataConfig:
    cache = a.data_cache_dir or os.path.join(os.path.dirname(os.path.abspath(a.data_path)), "index-cache")
    return DataConfig(sources=a.data_sources, split=a.split, cache_dir=cache, tokenizer_type=a.tokenizer_type,
                      tokenizer_model=a.tokenizer_model,
                      train_samples=a.train_iters * a.global_batch_size,
                      valid_samples=a.eval_iters * a.global_batch_size if a.eval_interval else 0)


def _optimizer(a: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=a.optimizer, lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, sgd_momentum=a.sgd_momentum, z_loss=a.z_loss,
        lr_warmup_iters=a.lr_warmup_iters, lr_decay_iters=a.lr_decay_iters, lr_decay_style=a.lr_decay_style,
        lr_wsd_decay_iters=a.lr_wsd_decay_iters or 0, lr_wsd_decay_style=a.lr_wsd_decay_style,
        lr_warmup_init=a.lr_warmup_init)


def _checkpoint(a: argparse.Namespace) -> CheckpointConfig:
    return CheckpointConfig(
        save=a.save, load=a.load, load_hf=a.load_hf, save_interval=a.save_interval,
        trust_checkpoint=a.trust_checkpoint, ckpt_format=a.ckpt_format, async_save=a.async_save,
        save_retain=a.save_retain, save_retain_every=a.save_retain_every, finetune=a.finetune,
        no_load_optim=a.no_load_optim, no_load_rng=a.no_load_rng, ckpt_step=a.ckpt_step)


def _logging(a: argparse.Namespace) -> LoggingConfig:
    return LoggingConfig(
        log_interval=a.log_interval, tensorboard_dir=a.tensorboard_dir, run_dir=a.run_dir,
        runs_dir=a.runs_dir, run_name=a.run_name, tensorboard_queue_size=a.tensorboard_queue_size,
        peak_tflops=a.peak_tflops,
        remeasure_peak=a.remeasure_peak, megatron_notes=tuple(a.megatron_notes),
        log_params_norm=a.log_params_norm, log_num_zeros_in_grad=a.log_num_zeros_in_grad,
        tensorboard_log_interval=a.tensorboard_log_interval,
        log_learning_rate_to_tensorboard=a.log_learning_rate_to_tensorboard,
        log_gradient_norm_to_tensorboard=a.log_gradient_norm_to_tensorboard,
        log_batch_size_to_tensorboard=a.log_batch_size_to_tensorboard,
        log_world_size_to_tensorboard=a.log_world_size_to_tensorboard,
        wandb_project=a.wandb_project, wandb_exp_name=a.wandb_exp_name, wandb_save_dir=a.wandb_save_dir)


def _runtime(a: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        train_iters=a.train_iters, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
        checkpoint_activations=a.checkpoint_activations, checkpoint_num_layers=a.checkpoint_num_layers,
        compile=a.compile, exit_interval=a.exit_interval,
        exit_duration_in_mins=a.exit_duration_in_mins, exit_signal_handler=a.exit_signal_handler,
        deepspeed_config=a.deepspeed_config, iterations_to_skip=tuple(a.iterations_to_skip),
        max_consecutive_skipped_iterations=a.max_consecutive_skipped_iterations,
        kernel_fusion=getattr(a, "kernel_fusion", "auto"), triton_kernels=getattr(a, "triton_kernels", True),
        manual_gc=bool(getattr(a, "manual_gc", False)),
        manual_gc_interval=getattr(a, "manual_gc_interval", 0))


def resolve(args: argparse.Namespace, model: ModelConfig, device_type: str,
            plugin_classes: Sequence[type] = ()) -> Config:
    """The typed configuration of validated ``args`` on a ``device_type`` ("cuda", "cpu") rank, with the
    typed config of each of ``plugin_classes`` (pure: reads ``args``, changes nothing)."""
    a = args
    engine = engine_config(a, device_type)
    parallel = ParallelConfig(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size, sequence_parallel=a.sequence_parallel,
        data_parallel_size=a.data_parallel_size, distributed_backend=a.distributed_backend,
        distributed_timeout_minutes=a.distributed_timeout_minutes,
        async_tensor_model_parallel_allreduce=getattr(a, "async_tensor_model_parallel_allreduce", True),
        virtual_pipeline_layers=getattr(a, "num_layers_per_virtual_pipeline_stage", None))
    plugins = {getattr(cls, "name", cls.__name__): plugin_config(cls, a) for cls in plugin_classes}
    return Config(
        model=model, parallel=parallel, data=_data(a), optimizer=_optimizer(a), checkpoint=_checkpoint(a),
        logging=_logging(a), runtime=_runtime(a), engine=engine, plugins=MappingProxyType(plugins),
    )
