"""The DeepSpeed config generated from flags, merged with a user JSON that must agree with them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megapost.config.errors import ConfigError

# (path in the DeepSpeed JSON, argparse dest) pairs that both may set.
SHARED_KEYS: list[tuple[tuple[str, ...], str]] = [
    (("train_batch_size",), "global_batch_size"),
    (("train_micro_batch_size_per_gpu",), "micro_batch_size"),
    (("gradient_clipping",), "clip_grad"),
    (("zero_optimization", "stage"), "zero_stage"),
    (("bf16", "enabled"), "bf16"),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def reconcile_with_user_config(args: argparse.Namespace) -> dict[str, Any]:
    """Read --deepspeed_config; adopt its values for flags the user did not type, and refuse a
    value that contradicts a typed flag. Returns the user's dict (empty without one)."""
    if not args.deepspeed_config:
        return {}
    try:
        with open(args.deepspeed_config) as f:
            user = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed_config {args.deepspeed_config}: {e}") from e
    if "optimizer" in user or "scheduler" in user:
        raise ConfigError(
            f"--deepspeed_config {args.deepspeed_config}: remove 'optimizer'/'scheduler'; megapost builds "
            "AdamW and the warmup+cosine schedule from --lr, --min-lr, --adam-beta1/2, --weight-decay"
        )
    for path, dest in SHARED_KEYS:
        value = _get(user, path)
        if value is None:
            continue
        ours = getattr(args, dest)
        if dest in args.explicit and value != ours:
            raise ConfigError(
                f"--{dest.replace('_', '-')} {ours} disagrees with {'.'.join(path)}={value} in "
                f"--deepspeed_config {args.deepspeed_config}; drop one of them"
            )
        setattr(args, dest, type(ours)(value) if ours is not None else value)
    return user


def build_ds_config(args: argparse.Namespace, user: dict[str, Any]) -> dict[str, Any]:
    """The full config handed to deepspeed.initialize (after validate_args set grad_accum_steps)."""
    config: dict[str, Any] = json.loads(json.dumps(user))  # deep copy
    if user.get("gradient_accumulation_steps") not in (None, args.grad_accum_steps):
        raise ConfigError(
            f"gradient_accumulation_steps={user['gradient_accumulation_steps']} in --deepspeed_config "
            f"contradicts global/(micro x dp) = {args.grad_accum_steps}"
        )
    config.update(
        train_batch_size=args.global_batch_size,
        train_micro_batch_size_per_gpu=args.micro_batch_size,
        gradient_accumulation_steps=args.grad_accum_steps,
        gradient_clipping=args.clip_grad,
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
    zero["stage"] = args.zero_stage
    config["bf16"] = {**config.get("bf16", {}), "enabled": bool(args.bf16)}
    if args.bf16:
        # Megatron's bf16: fp32 master weights and fp32 gradient accumulation. DeepSpeed provides them
        # through its ZeRO-1 BF16 optimizer (at DP=1 nothing is partitioned); its ZeRO-0 bf16 path
        # would step bf16 weights directly, so stage 0 is promoted to 1.
        zero["stage"] = args.zero_stage = max(1, args.zero_stage)
        if zero["stage"] == 1:
            config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
            # Add each bf16 gradient into the fp32 accumulator as autograd produces it and free it,
            # instead of zeroing, accumulating and copying every bf16 gradient once per micro-batch.
            config["bf16"].setdefault("immediate_grad_update", True)
        # DeepSpeed would all-reduce the fp32-accumulated gradients in bf16 (its default for bf16),
        # rounding them to 8 bits of mantissa every step; reduce them in fp32, as Megatron does.
        config.setdefault("communication_data_type", "fp32")
    return config
