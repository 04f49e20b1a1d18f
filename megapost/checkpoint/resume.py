"""Loading a tag into a run (``--load``), with Megatron's ``--finetune``, ``--no-load-optim`` and
``--no-load-rng``: megapost's layout-free state (:mod:`megapost.checkpoint.reader`, at the saving layout
through :mod:`megapost.checkpoint.own_shard`), or the Engine's own files where the tag has them at this
layout (``--ckpt-format deepspeed``). Everything goes through the Engine."""

from __future__ import annotations

import functools
import os
from typing import Any

from megapost.checkpoint import codec, own_shard, reader
from megapost.checkpoint.folder import CheckpointFolder
from megapost.checkpoint.format import DIR, has_native_files
from megapost.checkpoint.layout import RunLayout, check_layout
from megapost.config.errors import ConfigError
from megapost.config.resolved import CheckpointConfig
from megapost.engine import Engine

FRESH = {"global_steps": 0, "global_samples": 0, "skipped_steps": 0}


def load(engine: Engine, ckpt: CheckpointConfig, run: RunLayout,
         pstate: Any) -> tuple[int, int, dict[str, Any]]:
    """Returns (iteration, consumed samples, plugin states) of ``ckpt.load`` and restores RNG, with
    Megatron's ``--finetune`` (weights only; iteration, samples, optimizer, scheduler, RNG start fresh),
    ``--no-load-optim`` (no optimizer or scheduler state) and ``--no-load-rng``."""
    tag = CheckpointFolder(ckpt.load).resolve(step=ckpt.ckpt_step).tag
    finetune = ckpt.finetune
    optim = not (finetune or ckpt.no_load_optim)
    if check_layout(ckpt.load, run, ckpt.trust_checkpoint, ckpt.ckpt_step):
        own = functools.partial(own_shard.load, layout=run.deepspeed_layout())
        client = reader.load_layout_free(engine, pstate, os.path.join(ckpt.load, tag), optimizer=optim,
                                         counters=not finetune, own=own)
    else:
        client = _load_native(engine, ckpt.load, tag, optim, finetune)
    if not (finetune or ckpt.no_load_rng):
        codec.set_rng_state(client["rng"])
    if finetune:
        return 0, 0, {}
    return int(client["iteration"]), int(client["consumed_train_samples"]), client.get("plugins", {})


def _load_native(engine: Engine, load: str, tag: str, optim: bool, finetune: bool) -> dict[str, Any]:
    tag_dir = os.path.join(load, tag)
    if not has_native_files(tag_dir):
        raise ConfigError(f"--load {tag_dir}: the tag holds no checkpoint files (neither {DIR}/ "
                          "nor DeepSpeed's *.pt); load another tag (write its name into 'latest')")
    try:
        client = engine.load_native(load, tag, optimizer=optim, module_only=finetune)
    except RuntimeError as e:  # e.g. a pre-metadata checkpoint of another shape: size mismatch
        if "state_dict" not in str(e) and "size mismatch" not in str(e):
            raise
        detail = " ".join(" ".join(str(e).strip().splitlines()[:2]).split())[:300]
        raise ConfigError(f"--load {load}/{tag} does not fit this model ({detail}); "
                          "load a checkpoint of this model, or change the model flags to match it") from None
    if client is None:
        raise ConfigError(f"--load {load}: DeepSpeed could not load a checkpoint there")
    if finetune:
        engine.set_counters(FRESH)
    return client
