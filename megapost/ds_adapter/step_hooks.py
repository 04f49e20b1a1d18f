"""The seams megapost adds to a DeepSpeed engine: a callback just before the optimizer step (gradients
reduced, not yet applied), the sync-free steps that skip a non-finite gradient on every path
(``steps``), a recorded global grad norm on the fp32 path, and no gradient "all-reduce" over a
data-parallel group of one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from megapost.ds_adapter import grad_accum
from megapost.ds_adapter.steps import (
    Record,
    clip_fp32_grads,
    fused_with_found_inf,
    install_bf16_step,
    install_pipeline_loss_buffer,
    install_zero_step,
    non_finite,
)


def _fp32_path(engine: Any) -> bool:
    """The engine steps the torch optimizer itself (no bf16/fp16 wrapper, no ZeRO)."""
    return not (engine.bfloat16_enabled() or engine.fp16_enabled() or engine.zero_optimization())


def install(engine: Any, before_step: Callable[[], None], record: Record,
            fuse_grad_accumulation: bool = True) -> str:
    """Wrap ``engine._take_model_step`` (shared by DeepSpeed's plain and pipeline engines) and install
    the sync-free step of the engine's optimizer. Returns how a non-finite gradient norm is skipped:
    "device" (its flag handed to ``record`` every step), "deepspeed" (DeepSpeed's own host-synchronising
    step is kept, see ``steps``; it counts ``engine.skipped_steps``) or "none" (ZeRO-0 fp32 with a
    non-fused optimizer such as SGD: nothing skips)."""
    take_step = engine._take_model_step
    fp32 = _fp32_path(engine)
    on_device = fp32 and fused_with_found_inf(engine.optimizer)

    def clip_fp32_gradients() -> None:
        # DeepSpeed computes but drops this norm on the fp32/ZeRO-0 path; keep it for logging, as a
        # device tensor (converted only at log time), computed without host constants (steps).
        norm = clip_fp32_grads(engine.module.parameters(), engine.gradient_clipping(), engine.mpu)
        engine._global_grad_norm = norm.detach()
        if on_device:
            bad = non_finite(norm)
            record(bad)
            engine.optimizer.found_inf = bad.float()  # read by torch's fused AdamW.step

    def take_model_step(lr_kwargs: Any = None) -> None:
        before_step()
        if fp32 and engine.gradient_clipping() <= 0.0:
            clip_fp32_gradients()  # the norm and the skip flag, without a clip
        try:
            take_step(lr_kwargs)
        finally:
            engine.optimizer.__dict__.pop("found_inf", None)

    engine._take_model_step = take_model_step
    engine.clip_fp32_gradients = clip_fp32_gradients
    if isinstance(engine.optimizer, BF16_Optimizer):
        on_device = install_bf16_step(engine.optimizer, record)
        if fuse_grad_accumulation:
            grad_accum.install(engine.optimizer)  # one mixed-dtype add_ per gradient, no cast kernel
    elif isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        on_device = install_zero_step(engine.optimizer, record)
    if hasattr(engine, "train_batch") and hasattr(engine, "_aggregate_total_loss"):
        install_pipeline_loss_buffer(engine)
    return "device" if on_device else "none" if fp32 else "deepspeed"


def skipped_by_deepspeed(engine: Any) -> int:
    """Steps DeepSpeed's own step skipped (its overflow check; 0 where the sync-free step runs)."""
    return int(getattr(engine, "skipped_steps", 0))


def skip_single_rank_reduction(engine: Any) -> bool:
    """With one data-parallel rank, DeepSpeed's fallback reduction of the plain and bf16 optimizers
    still flattens every gradient into one buffer, all-reduces it over the one rank and copies it back
    (about a tenth of a bf16 step on CPU); turn it off there. ZeRO's own optimizers move gradients into
    their partitions in that reduction, so they keep it. Returns whether it was turned off."""
    if engine.zero_optimization() and not isinstance(engine.optimizer, BF16_Optimizer):
        return False
    engine.enable_backward_allreduce = False
    if hasattr(engine, "pipeline_enable_backward_allreduce"):
        engine.pipeline_enable_backward_allreduce = False
    return True
