"""The native engine of a run (``--use-distributed-optimizer``): what it refuses, and its construction
from the typed config, the parallel model and the lr schedule megapost builds for DeepSpeed too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from megapost.config.resolved import Config
from megapost.native.engine import NativeEngine
from megapost.native.pipeline import PipelineRunner, StageModel
from megapost.optim.optimizer import decays, optimizer_over
from megapost.optim.schedule import WarmupDecaySchedule
from megapost.optim.skips import SkipCounter
from megapost.parallel.build import build_model, make_loss_fn
from megapost.parallel.dist_optimizer import DistributedOptimizer
from megapost.parallel.layers import defer_sequence_parallel_reduction
from megapost.parallel.layout import validate_layout
from megapost.parallel.state import ParallelState

BUCKET_NUMEL: int | None = None  # elements per bucket; None: Megatron's default, max(40 M, 1 M x DP)


def selected(config: Config) -> bool:
    """Whether the run trains on the native engine (``--use-distributed-optimizer``)."""
    return config.engine.distributed_optimizer


def refusals(config: Config, user_ds: dict[str, Any]) -> list[str]:
    """One line per flag the native engine does not run (yet)."""
    flag, out = "--use-distributed-optimizer", []
    par, m = config.parallel, config.engine.batch.grad_accum_steps
    if par.virtual_pipeline_layers and m % max(1, m // par.pipeline_model_parallel_size):
        out.append(f"--num-layers-per-virtual-pipeline-stage with {m} micro-batches per step at "
                   f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size}: the interleaved "
                   f"schedule needs them in equal rounds (a multiple of PP, or fewer than 2 x PP)")
    if user_ds:
        out.append(f"{flag} with --deepspeed-config: the native engine runs no DeepSpeed (drop one)")
    return out


def notes(given: Mapping[str, Any], explicit: set[str]) -> list[str]:
    """Start-up notes of flags (``given``: as typed, by dest) that mean something else on the native
    engine."""
    out = []
    if "zero_stage" in explicit:
        out.append(f"--zero-stage {given['zero_stage']}: not DeepSpeed's here; megapost's distributed "
                   "optimizer shards the fp32 weights and optimizer state (ZeRO-1-like)")
    if "overlap_grad_reduce" in explicit and not given.get("overlap_grad_reduce"):
        out.append("--no-overlap-grad-reduce: megapost's distributed optimizer always reduce-scatters each "
                   "bucket as soon as its gradients are in")
    return out


def build_native_model(config: Config,
                       pstate: ParallelState) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """(model, loss_fn) of this rank: ``parallel.build_model``'s at PP 1; under PP this pipeline rank's
    chunks only (``megapost.native.pipeline.StageModel``, --num-layers-per-virtual-pipeline-stage's
    virtual stages)."""
    run, cfg, par = config.runtime, config.model, config.parallel
    if pstate.pp_size == 1:
        return build_model(cfg, pstate, checkpoint_activations=run.checkpoint_activations,
                           checkpoint_num_layers=run.checkpoint_num_layers, z_loss=config.optimizer.z_loss)
    validate_layout(cfg, pstate.tp_size, pstate.pp_size, pstate.sequence_parallel, cfg.seq_length,
                    pstate.world_size)
    every = run.checkpoint_num_layers if run.checkpoint_activations else 0
    model = StageModel(cfg, pstate, par.virtual_stages(cfg.num_layers), every)
    return model, make_loss_fn(pstate, config.optimizer.z_loss)


def build_native(config: Config, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 pstate: ParallelState, device: torch.device,
                 make_schedule: Callable[[torch.optim.Optimizer], WarmupDecaySchedule]) -> NativeEngine:
    """The engine over ``model`` (moved to ``device``, cast to bf16 under --bf16 as DeepSpeed casts it):
    megapost's optimizer groups (no decay on 1-D) on the fp32 shards, the global-norm clip over the
    data- and tensor-parallel groups (replicated parameters counted once), the sequence-parallel norm
    gains' partial sums reduced once per step, and ``make_schedule`` over the shards' optimizer. Under
    PP (``model`` a ``StageModel``): the pipeline group among the norm's groups (the norm, and so the
    skip on a non-finite one, is every rank's), the step's micro-batches through the schedule."""
    model.to(device)
    if config.engine.bf16:
        model.to(torch.bfloat16)
    tp = pstate.tp_group if pstate.tp_size > 1 else None
    pp = pstate.pp_group if pstate.pp_size > 1 else None
    deferred = defer_sequence_parallel_reduction(model) if tp is not None and pstate.sequence_parallel else []
    params = [p for p in model.parameters() if p.requires_grad]
    eng = config.engine
    bucket = BUCKET_NUMEL or max(40_000_000, 1_000_000 * pstate.dp_size)

    def make_optimizer(groups: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
        return optimizer_over(groups[0], groups[1] if len(groups) > 1 else [], config.optimizer)

    def norm_weight(p: nn.Parameter) -> float:
        return 1.0 if getattr(p, "tensor_model_parallel", False) or pstate.tp_rank == 0 else 0.0

    dist_opt = DistributedOptimizer(
        params, make_optimizer, pstate.dp_group,
        reduce_dtype=torch.bfloat16 if eng.grad_reduce_in_bf16 else torch.float32, bucket_numel=bucket,
        clip_grad=eng.clip_grad, norm_groups=[g for g in (tp, pp) if g is not None], norm_weight=norm_weight,
        partial_sums=(tp, deferred) if deferred else None, group_of=lambda p: 0 if decays(p) else 1)
    hooks = dist_opt.install_forward_hooks(model.modules())
    skips = SkipCounter(device, config.runtime.max_consecutive_skipped_iterations)
    runner = None
    if isinstance(model, StageModel):
        runner = PipelineRunner(model, pstate, eng.batch.grad_accum_steps, eng.batch.micro_batch_size,
                                loss_fn, device, lambda last: dist_opt.start_micro_batch(last=last))
    return NativeEngine(model, loss_fn, dist_opt, make_schedule(dist_opt.optimizer), skips,
                        replicated_owner=pstate.tp_rank == 0, hooks=hooks,
                        samples_per_step=eng.batch.global_batch_size, pipeline=runner)


def start_note(engine: NativeEngine, config: Config) -> str:
    """The start-up line: what the native engine runs."""
    d = engine.dist
    dtype = "bf16" if d.reduce_dtype == torch.bfloat16 else "fp32"
    n, runner = len(d.buckets), engine.pipeline
    line = (f"--use-distributed-optimizer: megapost's distributed optimizer (no DeepSpeed): {n} "
            f"bucket{'s' if n > 1 else ''} reduce-scattered in {dtype} in the last micro-batch's "
            f"backward, fp32 shards of 1/{d.size}, weights all-gathered bucket by bucket in the next forward")
    if runner is None:
        return line
    v = len(runner.model.chunks)
    kind = f"interleaved 1F1B, {v} virtual stages per rank" if v > 1 else "1F1B"
    return (f"{line}; pipeline: {kind} (torch.distributed.pipelining), stages "
            f"{runner.model.stage_ids} of {v * config.parallel.pipeline_model_parallel_size} on this rank")
