"""The DeepSpeed config generated from the resolved engine section, merged with the user's JSON (which
megapost.config.deepspeed_json reconciled with the flags at parse time)."""

from __future__ import annotations

import json
from typing import Any

from megapost.config.errors import ConfigError
from megapost.config.resolved import EngineConfig


def build_ds_config(engine: EngineConfig, user: dict[str, Any]) -> dict[str, Any]:
    """The full config handed to deepspeed.initialize."""
    config: dict[str, Any] = json.loads(json.dumps(user))  # deep copy
    if user.get("gradient_accumulation_steps") not in (None, engine.batch.grad_accum_steps):
        raise ConfigError(
            f"gradient_accumulation_steps={user['gradient_accumulation_steps']} in --deepspeed_config "
            f"contradicts global/(micro x dp) = {engine.batch.grad_accum_steps}"
        )
    config.update(
        train_batch_size=engine.batch.global_batch_size,
        train_micro_batch_size_per_gpu=engine.batch.micro_batch_size,
        gradient_accumulation_steps=engine.batch.grad_accum_steps,
        gradient_clipping=engine.clip_grad,
        steps_per_print=config.get("steps_per_print", 10**9),
        wall_clock_breakdown=config.get("wall_clock_breakdown", False),
        zero_allow_untested_optimizer=True,
    )
    # DeepSpeed's throughput timer defaults to enabled + synchronized: two device synchronize() per
    # micro-batch (forward pre-hook and step). megapost measures throughput itself (metrics/throughput).
    timers = config.setdefault("timers", {}).setdefault("throughput", {})
    timers.setdefault("enabled", False)
    timers.setdefault("synchronized", False)
    zero = config.setdefault("zero_optimization", {})
    # Megatron's bf16: fp32 master weights and fp32 gradient accumulation. DeepSpeed provides them
    # through its ZeRO-1 BF16 optimizer (at DP=1 nothing is partitioned); its ZeRO-0 bf16 path would
    # step bf16 weights directly, so stage 0 runs as 1 (megapost.config.resolved.grad_reduction).
    zero["stage"] = engine.zero_stage
    config["bf16"] = {**config.get("bf16", {}), "enabled": engine.bf16}
    if engine.bf16:
        if zero["stage"] == 1:
            config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
            # Add each bf16 gradient into the fp32 accumulator as autograd produces it and free it,
            # instead of zeroing, accumulating and copying every bf16 gradient once per micro-batch.
            config["bf16"].setdefault("immediate_grad_update", True)
        # DeepSpeed would all-reduce the fp32-accumulated gradients in bf16 (its default for bf16),
        # rounding them to 8 bits of mantissa every step; reduce them in fp32, as Megatron does.
        config.setdefault("communication_data_type", "fp32")
    return config
