"""The resolved, typed configuration: one pure ``resolve(args, model)`` after parsing and validation
turns the flags (presets applied, Megatron flags mapped, batch arithmetic and run directory done)
into frozen sections, each the input of one part of the build (megapost.train.build). ``to_json``
is the run's ``args.json``: every flag by name (flat, as before) and the sections under ``resolved``."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from megapost.model.config import ModelConfig


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


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: str | None
    run_dir: str | None
    peak_tflops: float
    remeasure_peak: bool
    megatron_notes: tuple[str, ...]


@dataclass(frozen=True)
class RuntimeConfig:
    train_iters: int
    eval_interval: int
    eval_iters: int
    bf16: bool
    zero_stage: int  # as DeepSpeed runs it: --bf16 promotes stage 0 to 1 (megapost.engine.ds_config)
    checkpoint_activations: bool
    checkpoint_num_layers: int
    compile: bool
    seed: int
    exit_interval: int
    exit_duration_in_mins: float
    exit_signal_handler: bool
    deepspeed_config: str | None
    plugins: str


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    flags: MappingProxyType  # every parsed flag by dest (plugins' included), read-only

    def to_json(self) -> dict[str, Any]:
        sections = {name: asdict(getattr(self, name)) for name in
                    ("model", "parallel", "data", "optimizer", "checkpoint", "logging", "runtime")}
        sections["data"]["sources"] = repr(self.data.sources)
        return {**self.flags, "resolved": sections}


def resolve(args: argparse.Namespace, model: ModelConfig) -> Config:
    """The typed configuration of validated ``args`` (pure: reads ``args``, changes nothing)."""
    a = args
    zero_stage = max(1, a.zero_stage) if a.bf16 else a.zero_stage
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
        checkpoint=CheckpointConfig(a.save, a.load, a.load_hf, a.save_interval, a.trust_checkpoint),
        logging=LoggingConfig(a.log_interval, a.tensorboard_dir, a.run_dir, a.peak_tflops, a.remeasure_peak,
                              tuple(a.megatron_notes)),
        runtime=RuntimeConfig(a.train_iters, a.eval_interval, a.eval_iters, bool(a.bf16),
                              zero_stage, a.checkpoint_activations,
                              a.checkpoint_num_layers, a.compile, a.seed, a.exit_interval,
                              a.exit_duration_in_mins, a.exit_signal_handler, a.deepspeed_config, a.plugins),
        flags=MappingProxyType({**{k: v for k, v in vars(a).items() if k != "explicit"},
                                "zero_stage": zero_stage}),
    )
