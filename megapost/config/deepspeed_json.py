"""The user's ``--deepspeed_config`` JSON at parse time: its values for flags the user did not type are
adopted, a value that contradicts a typed flag is refused (megapost.optim.ds_config merges the rest)."""

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
