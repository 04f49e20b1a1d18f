"""Checkpoints through DeepSpeed's engine plus the client state needed to continue exactly."""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import numpy as np
import torch

from .arguments import ConfigError
from .utils.atomic import atomic_path

META_FILE = "megapost_meta.json"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(args: argparse.Namespace) -> dict[str, int]:
    return {"tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size}


def save(engine: Any, args: argparse.Namespace, iteration: int, consumed: int,
         plugin_states: dict[str, Any]) -> str:
    """Save tag ``iter_XXXXXXX``; DeepSpeed moves ``latest`` only after every file is written."""
    tag = f"iter_{iteration:07d}"
    client = {"iteration": iteration, "consumed_train_samples": consumed, "rng": rng_state(),
              "plugins": plugin_states,
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}}
    if engine.global_rank == 0:  # before DeepSpeed writes 'latest', so a loadable tag always has it
        meta = {"tag": tag, "iteration": iteration, **_layout(args),
                "data_parallel_size": args.data_parallel_size, "zero_stage": args.zero_stage}
        with atomic_path(os.path.join(args.save, tag, META_FILE)) as tmp, open(tmp, "w") as f:
            json.dump(meta, f)
    engine.save_checkpoint(args.save, tag=tag, client_state=client)
    return tag


def check_layout(args: argparse.Namespace) -> None:
    """Refuse to load a checkpoint written at another TP/PP layout (it would load wrong shards)."""
    latest = os.path.join(args.load, "latest")
    if not os.path.isfile(latest):
        raise ConfigError(f"--load {args.load}: no 'latest' file; is this a megapost/DeepSpeed checkpoint?")
    with open(latest) as f:
        tag = f.read().strip()
    meta_path = os.path.join(args.load, tag, META_FILE)
    if not os.path.isfile(meta_path):
        return
    with open(meta_path) as f:
        meta = json.load(f)
    for key, ours in _layout(args).items():
        if meta.get(key, ours) != ours:
            raise ConfigError(
                f"--load {args.load} was saved with --{key.replace('_', '-')} {meta[key]} but this run uses "
                f"{ours}; resume at the saved layout, or convert it with DeepSpeed's universal checkpoint "
                "(python -m deepspeed.checkpoint.ds_to_universal --input_folder <tag dir> --output_folder "
                "<out>) and load that with a universal-checkpoint-aware loader"
            )
    saved_dp, zero = meta.get("data_parallel_size"), max(meta.get("zero_stage", 0), args.zero_stage)
    if saved_dp is not None and saved_dp != args.data_parallel_size and zero >= 1:
        raise ConfigError(
            f"--load {args.load} holds ZeRO optimizer shards for {saved_dp} data-parallel ranks but this "
            f"run has {args.data_parallel_size}; resume with {saved_dp} x TP x PP ranks (or convert with "
            "python -m deepspeed.checkpoint.ds_to_universal)"
        )


def load(engine: Any, args: argparse.Namespace) -> tuple[int, int, dict[str, Any]]:
    """Returns (iteration, consumed samples, plugin states) and restores RNG."""
    check_layout(args)
    path, client = engine.load_checkpoint(args.load)
    if path is None or client is None:
        raise ConfigError(f"--load {args.load}: DeepSpeed could not load a checkpoint there")
    set_rng_state(client["rng"])
    return int(client["iteration"]), int(client["consumed_train_samples"]), client.get("plugins", {})
