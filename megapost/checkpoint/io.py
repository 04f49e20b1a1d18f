"""Checkpoint directories: tags, ``latest``, model shape and layout checks, load.

A tag is written under ``iter_XXXXXXX.tmp`` and renamed to ``iter_XXXXXXX`` by rank 0 once every rank
has written its files (:mod:`megapost.checkpoint.saver`); ``latest`` is then replaced atomically. A
leftover ``*.tmp`` tag (a crash during a save) is never named by ``latest`` and is removed by the next
save. The checkpoint is megapost's sharded safetensors state (:mod:`megapost.checkpoint.sharded`,
read by :mod:`megapost.checkpoint.layout_free`); DeepSpeed's own files, written only with
``--ckpt-format deepspeed``, are read with :mod:`megapost.checkpoint.safety`'s weights-only loader.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapost.checkpoint import layout_free, own_shard
from megapost.checkpoint import safety as checkpoint_safety
from megapost.checkpoint.folder import CheckpointFolder
from megapost.config.errors import ConfigError
from megapost.config.resolved import CheckpointConfig

META_FILE = "megapost_meta.json"
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
              "norm_position", "mix_post_fraction", "qk_norm")
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
               "zero_stage", "bf16", "sequence_parallel")


# ---- RNG state, pickle-free -------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    if isinstance(np_state, dict):
        np_state = (np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- what a checkpoint is of --------------------------------------------------------------------
def model_shape(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The model's shape as the flags (by dest) give it (``padded_vocab_size`` is set once the tokenizer
    is known)."""
    shape = {k: flags.get(k) for k in SHAPE_KEYS}
    if shape["norm_position"] != "mix":
        shape["mix_post_fraction"] = None  # meaningless for the other placements
    return shape


@dataclass(frozen=True)
class RunLayout:
    """What a checkpoint is written at and checked against: the model's shape and the parallel layout
    (``zero_stage``: before resolution as given, after it as the engine runs it)."""

    shape: dict[str, Any]
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    bf16: bool
    sequence_parallel: bool

    @classmethod
    def of(cls, flags: Mapping[str, Any]) -> RunLayout:
        """From the flags by dest: the root's before resolution, ``Config.flags`` after it."""
        return cls(model_shape(flags), *(flags[k] for k in LAYOUT_KEYS))

    def deepspeed_layout(self) -> dict[str, Any]:
        """What makes DeepSpeed's own files layout-specific (``layout_free.layout_of``)."""
        return layout_free.layout_of(**{k: getattr(self, k) for k in LAYOUT_KEYS})


def describe_shape(shape: dict[str, Any]) -> str:
    return (f"{shape.get('num_layers')} layers x {shape.get('hidden_size')} hidden, ffn "
            f"{shape.get('ffn_hidden_size')}, {shape.get('num_attention_heads')} heads, vocab "
            f"{shape.get('padded_vocab_size')}, {shape.get('norm_position')}-norm"
            + (f" rho {shape['mix_post_fraction']}" if shape.get("mix_post_fraction") is not None else "")
            + (", qk-norm" if shape.get("qk_norm") else ""))


def _shape_differs(saved: dict[str, Any] | None, ours: dict[str, Any]) -> bool:
    if not saved:
        return False  # a checkpoint from before shapes were recorded
    return any(saved.get(k) is not None and ours.get(k) is not None and saved[k] != ours[k]
               for k in SHAPE_KEYS)


# ---- reading a checkpoint directory (megapost.checkpoint.folder: the one reader of 'latest') -------
def complete_tags(directory: str) -> list[str]:
    """The published tags of ``directory``, by iteration."""
    return CheckpointFolder(directory).tags()


def last_complete(directory: str | None) -> str | None:
    """``dir/tag`` a resume from ``directory`` would load now, else None."""
    return CheckpointFolder(directory).last_complete() if directory else None


def latest_tag(directory: str, flag: str = "--load", step: int | None = None) -> str:
    """The tag to load (``CheckpointFolder.resolve``); a one-line error when there is none."""
    return CheckpointFolder(directory).resolve(flag, step).tag


def read_meta(directory: str, tag: str) -> dict[str, Any] | None:
    path = os.path.join(directory, tag, META_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is truncated or not valid JSON ({e}); resume from another tag (write "
                          "its name into 'latest')") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is not a JSON object; resume from another tag (write its name into "
                          "'latest')")
    return meta


def check_layout(load: str, run: RunLayout, trust: bool = False, step: int | None = None) -> bool:
    """True when the checkpoint at ``load`` loads from megapost's sharded state (always, unless the tag
    also has DeepSpeed's files of this layout: ``--ckpt-format deepspeed``).
    Refuses another model shape, a partial checkpoint, another layout when the tag has no layout-free
    state, and unreadable ``latest``/meta/``.pt`` files (``trust``: --trust-checkpoint) — on every rank
    alike, before any group forms. ``step``: --ckpt-step."""
    tag = latest_tag(load, step=step)
    meta = read_meta(load, tag)
    if meta is not None and _shape_differs(meta.get("model"), run.shape):
        raise ConfigError(f"--load {load} holds a different model ({tag}: "
                          f"{describe_shape(meta['model'])}) than this run ({describe_shape(run.shape)}); "
                          "load a checkpoint of this model, or change the model flags to match it")
    tag_dir = os.path.join(load, tag)
    if layout_free.check_complete(tag_dir):
        if not _has_deepspeed_files(tag_dir):
            return True
        header, _ = layout_free.read_state(tag_dir)
        if header["layout"] != run.deepspeed_layout():
            return True
    if meta is not None:
        _refuse_other_layout(load, run, meta)
    checkpoint_safety.scan_files(tag_dir, trust=trust)
    return False


def _refuse_other_layout(load: str, run: RunLayout, meta: dict[str, Any]) -> None:
    """A checkpoint without layout-free state loads only at the layout that wrote it."""
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        ours = getattr(run, key)
        if meta.get(key, ours) != ours:
            raise ConfigError(
                f"--load {load} was saved with --{key.replace('_', '-')} {meta[key]} but this run uses "
                f"{ours}, and it predates megapost's layout-free checkpoints; resume at the saved layout"
            )
    saved_dp, zero = meta.get("data_parallel_size"), max(meta.get("zero_stage", 0), run.zero_stage)
    if saved_dp is not None and saved_dp != run.data_parallel_size and zero >= 1:
        raise ConfigError(
            f"--load {load} holds ZeRO optimizer shards for {saved_dp} data-parallel ranks but this "
            f"run has {run.data_parallel_size}, and it predates megapost's layout-free checkpoints; resume "
            f"with {saved_dp} x TP x PP ranks"
        )


def check_save_dir(save: str | None, shape: dict[str, Any]) -> None:
    """Refuse to save into ``save`` when its latest checkpoint is of another model than ``shape``."""
    if not save or not os.path.isfile(os.path.join(save, "latest")):
        return
    try:
        tag = latest_tag(save, flag="--save")
        meta = read_meta(save, tag)
    except ConfigError:
        return  # nothing usable there to protect; the first save replaces 'latest'
    if meta and _shape_differs(meta.get("model"), shape):
        raise ConfigError(f"--save {save} already holds a checkpoint of another model ({tag}: "
                          f"{describe_shape(meta['model'])}; this run: {describe_shape(shape)}); use another "
                          "--save (or --run-name) for this run")


# ---- saving: megapost.checkpoint.saver writes; the cleanup of what a failed save left ----------
def _has_deepspeed_files(tag_dir: str) -> bool:
    return any(n.endswith(".pt") for n in os.listdir(tag_dir))


def load(engine: Any, ckpt: CheckpointConfig, run: RunLayout, pstate: Any) -> tuple[int, int, dict[str, Any]]:
    """Returns (iteration, consumed samples, plugin states) of ``ckpt.load`` and restores RNG, with
    Megatron's ``--finetune`` (weights only; iteration, samples, optimizer, scheduler, RNG start fresh),
    ``--no-load-optim`` (no optimizer or scheduler state) and ``--no-load-rng``. A tag with DeepSpeed's
    files at this layout loads through DeepSpeed; every other tag from megapost's sharded state."""
    tag = latest_tag(ckpt.load, step=ckpt.ckpt_step)
    finetune = ckpt.finetune
    optim = not (finetune or ckpt.no_load_optim)
    if check_layout(ckpt.load, run, ckpt.trust_checkpoint, ckpt.ckpt_step):
        own = functools.partial(own_shard.load, layout=run.deepspeed_layout())
        client = layout_free.load_layout_free(engine, pstate, os.path.join(ckpt.load, tag), optimizer=optim,
                                              counters=not finetune, own=own)
    else:
        client = _load_deepspeed(engine, ckpt.load, tag, optim, finetune)
    if not (finetune or ckpt.no_load_rng):
        set_rng_state(client["rng"])
    if finetune:
        return 0, 0, {}
    return int(client["iteration"]), int(client["consumed_train_samples"]), client.get("plugins", {})


def _load_deepspeed(engine: Any, load: str, tag: str, optim: bool, finetune: bool) -> dict[str, Any]:
    tag_dir = os.path.join(load, tag)
    if not _has_deepspeed_files(tag_dir):
        raise ConfigError(f"--load {tag_dir}: the tag holds no checkpoint files (neither {layout_free.DIR}/ "
                          "nor DeepSpeed's *.pt); load another tag (write its name into 'latest')")
    try:
        path, client = engine.load_checkpoint(load, tag=tag, load_optimizer_states=optim,
                                              load_lr_scheduler_states=optim, load_module_only=finetune)
    except RuntimeError as e:  # e.g. a pre-metadata checkpoint of another shape: size mismatch
        if "state_dict" not in str(e) and "size mismatch" not in str(e):
            raise
        detail = " ".join(" ".join(str(e).strip().splitlines()[:2]).split())[:300]
        raise ConfigError(f"--load {load}/{tag} does not fit this model ({detail}); "
                          "load a checkpoint of this model, or change the model flags to match it") from None
    if path is None or client is None:
        raise ConfigError(f"--load {load}: DeepSpeed could not load a checkpoint there")
    if finetune:
        engine.global_steps = engine.global_samples = engine.skipped_steps = 0
    return client
