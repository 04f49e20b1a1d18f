"""Checkpoints through DeepSpeed's engine plus the client state needed to continue exactly."""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import numpy as np
import torch

from . import layout_free
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
         plugin_states: dict[str, Any], pstate: Any) -> str:
    """Save tag ``iter_XXXXXXX``: DeepSpeed's files (same-layout resume) plus megapost's layout-free
    state (``megapost.layout_free``); ``latest`` moves only after both are complete."""
    tag = f"iter_{iteration:07d}"
    client = {"iteration": iteration, "consumed_train_samples": consumed, "rng": rng_state(),
              "plugins": plugin_states,
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}}
    if engine.global_rank == 0:  # before DeepSpeed writes 'latest', so a loadable tag always has it
        meta = {"tag": tag, "iteration": iteration, **_layout(args),
                "data_parallel_size": args.data_parallel_size, "zero_stage": args.zero_stage}
        with atomic_path(os.path.join(args.save, tag, META_FILE)) as tmp, open(tmp, "w") as f:
            json.dump(meta, f)
    engine.save_checkpoint(args.save, tag=tag, client_state=client, save_latest=False)
    layout_free.save_layout_free(engine, pstate, os.path.join(args.save, tag), args, client)
    if engine.global_rank == 0:
        with atomic_path(os.path.join(args.save, "latest")) as tmp, open(tmp, "w") as f:
            f.write(tag)
    return tag


def _latest_tag(args: argparse.Namespace) -> str:
    latest = os.path.join(args.load, "latest")
    if not os.path.isfile(latest):
        raise ConfigError(f"--load {args.load}: no 'latest' file; is this a megapost/DeepSpeed checkpoint?")
    with open(latest) as f:
        return f.read().strip()


def check_layout(args: argparse.Namespace) -> bool:
    """True when the checkpoint must be loaded from its layout-free state (saved at another layout);
    refuses a partial checkpoint, and another layout when the tag has no layout-free state."""
    tag_dir = os.path.join(args.load, _latest_tag(args))
    if layout_free.check_complete(tag_dir):
        header, _ = layout_free.read_state(tag_dir)
        return header["layout"] != layout_free.layout_of(args)
    meta_path = os.path.join(tag_dir, META_FILE)
    if not os.path.isfile(meta_path):
        return False
    with open(meta_path) as f:
        meta = json.load(f)
    for key, ours in _layout(args).items():
        if meta.get(key, ours) != ours:
            raise ConfigError(
                f"--load {args.load} was saved with --{key.replace('_', '-')} {meta[key]} but this run uses "
                f"{ours}, and it predates megapost's layout-free checkpoints; resume at the saved layout"
            )
    saved_dp, zero = meta.get("data_parallel_size"), max(meta.get("zero_stage", 0), args.zero_stage)
    if saved_dp is not None and saved_dp != args.data_parallel_size and zero >= 1:
        raise ConfigError(
            f"--load {args.load} holds ZeRO optimizer shards for {saved_dp} data-parallel ranks but this "
            f"run has {args.data_parallel_size}, and it predates megapost's layout-free checkpoints; resume "
            f"with {saved_dp} x TP x PP ranks"
        )
    return False


def load(engine: Any, args: argparse.Namespace, pstate: Any) -> tuple[int, int, dict[str, Any]]:
    """Returns (iteration, consumed samples, plugin states) and restores RNG. The same layout loads
    DeepSpeed's files; another layout loads the layout-free state."""
    if check_layout(args):
        client = layout_free.load_layout_free(engine, pstate, os.path.join(args.load, _latest_tag(args)))
    else:
        path, client = engine.load_checkpoint(args.load)
        if path is None or client is None:
            raise ConfigError(f"--load {args.load}: DeepSpeed could not load a checkpoint there")
    set_rng_state(client["rng"])
    return int(client["iteration"]), int(client["consumed_train_samples"]), client.get("plugins", {})
