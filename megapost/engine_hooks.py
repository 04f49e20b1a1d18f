"""The two seams megapost adds to a DeepSpeed engine: a callback just before the optimizer step
(gradients reduced, not yet applied) and a recorded global grad norm on the fp32 path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepspeed.runtime.utils import clip_grad_norm_


def install(engine: Any, before_step: Callable[[], None]) -> None:
    """Wrap ``engine._take_model_step`` (shared by DeepSpeed's plain and pipeline engines)."""
    take_step = engine._take_model_step

    def take_model_step(lr_kwargs: Any = None) -> None:
        before_step()
        take_step(lr_kwargs)

    engine._take_model_step = take_model_step

    def clip_fp32_gradients() -> None:
        # DeepSpeed computes but drops this norm on the fp32/ZeRO-0 path; keep it for logging.
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_fp32_gradients
