"""The seams megapost adds to a DeepSpeed engine: a callback just before the optimizer step
(gradients reduced, not yet applied), a recorded global grad norm on the fp32 path, and no gradient
"all-reduce" over a data-parallel group of one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from megapost.engine.sync_free import (
    clip_fp32_grads,
    install_bf16_step,
    install_pipeline_loss_buffer,
    install_zero_step,
)


def install(engine: Any, before_step: Callable[[], None], dp_size: int | None = None) -> None:
    """Wrap ``engine._take_model_step`` (shared by DeepSpeed's plain and pipeline engines); with
    ``dp_size`` 1, skip the engine's data-parallel gradient reduction (see ``skip_single_rank_reduction``)."""
    take_step = engine._take_model_step

    def take_model_step(lr_kwargs: Any = None) -> None:
        before_step()
        take_step(lr_kwargs)

    engine._take_model_step = take_model_step

    def clip_fp32_gradients() -> None:
        # DeepSpeed computes but drops this norm on the fp32/ZeRO-0 path; keep it for logging, as a
        # device tensor (converted only at log time), computed without host constants (sync_free).
        norm = clip_fp32_grads(engine.module.parameters(), engine.gradient_clipping(), engine.mpu)
        engine._global_grad_norm = norm.detach()

    engine.clip_fp32_gradients = clip_fp32_gradients
    if isinstance(engine.optimizer, BF16_Optimizer):
        install_bf16_step(engine.optimizer)
    elif isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        install_zero_step(engine.optimizer)
    if hasattr(engine, "train_batch") and hasattr(engine, "_aggregate_total_loss"):
        install_pipeline_loss_buffer(engine)
    if dp_size == 1:
        skip_single_rank_reduction(engine)


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
