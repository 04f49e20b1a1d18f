"""The format of a tag: file names, the one ``FORMAT`` number, the manifest and the headers' schema.

A tag ``<folder>/iter_XXXXXXX/`` (names: :mod:`megapost.checkpoint.folder`) holds:

* ``megapost_meta.json`` (``META_FILE``): tag, iteration, format, ckpt_format, data identity, the
  saving layout (TP, PP, DP, ZeRO stage) and the model's shape — read before any group forms.
* ``layout_free/`` (``DIR``), safetensors only (nothing in them can run code):

  - ``shard-tpTT-ppPP-dpDD.safetensors``, one per rank: 1-D tensors ``fp32/<name>`` and
    ``<key>/<name>`` (each optimizer-state key) of the fragment of every parameter the rank owns, and
    its RNG (``rng.*``). Header metadata ``megapost`` (JSON): ``format``, ``tp_rank``, ``pp_rank``,
    ``dp_rank``, ``rng`` (encoded, :mod:`megapost.checkpoint.codec`) and ``params``: per name
    ``shape`` (full), ``local`` (this TP piece's shape), ``start``/``numel`` (the fragment in the
    flattened piece), ``spec`` (the split its layer declared: ``{"dim", "replicas"}``,
    :class:`megapost.parallel.shard_spec.ShardSpec`; format 3 on) and ``dim``/``offset`` (the piece's
    place in the full tensor).
  - ``state.safetensors`` (``STATE``), from the logging rank: ``format``, ``iteration``,
    ``consumed_train_samples``, ``adam_step``, ``state_keys``, ``param_groups``, ``scheduler``,
    ``model_config``, ``layout`` (:func:`layout_of`), ``args`` (``tokenizer_model``), ``engine``
    (counters), ``shards`` (every rank's file name), ``rng`` and ``plugins`` (encoded).
  - ``manifest.json`` (``MANIFEST``), written last by rank 0: ``{"format", "files": {path: size}}``.

Formats: 3 records each piece's shard spec; 2 (before) recorded only ``dim``/``offset``, which the
reader then trusts as given; 1 (older) wrote ``shard-tpTT-ppPP.safetensors`` per (TP, PP) rank, full
over data parallelism. DeepSpeed's own ``*.pt`` files appear only under ``--ckpt-format deepspeed``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_path

FORMAT = 3  # of the manifest, the state file and every shard file
META_FILE = "megapost_meta.json"
DIR = "layout_free"
STATE = "state.safetensors"
MANIFEST = "manifest.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state keys (a tag from before state_keys were recorded)


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    """A rank's file (format 2 on)."""
    return f"shard-tp{tp_rank:02d}-pp{pp_rank:02d}-dp{dp_rank:02d}.safetensors"


def all_shard_files(pstate: Any) -> list[str]:
    return [shard_file(t, p, d) for p in range(pstate.pp_size) for t in range(pstate.tp_size)
            for d in range(pstate.dp_size)]


def layout_of(*, tensor_model_parallel_size: int, pipeline_model_parallel_size: int, data_parallel_size: int,
              zero_stage: int, bf16: bool, sequence_parallel: bool) -> dict[str, Any]:
    """The saving layout as the state file records it (the effective ZeRO stage: bf16 runs use >= 1)."""
    zero = max(1, zero_stage) if bf16 else zero_stage
    return {"tensor_model_parallel_size": tensor_model_parallel_size,
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
            "data_parallel_size": data_parallel_size, "zero_stage": zero, "bf16": bool(bf16),
            "sequence_parallel": bool(sequence_parallel)}


def has_native_files(tag_dir: str) -> bool:
    """The tag holds DeepSpeed's own ``*.pt`` files."""
    return any(n.endswith(".pt") for n in os.listdir(tag_dir))


def write_manifest(tag_dir: str) -> None:
    """Every file under ``tag_dir`` (relative path -> size); written last."""
    files = {}
    for root, _, names in os.walk(tag_dir):
        for n in names:
            path = os.path.join(root, n)
            rel = os.path.relpath(path, tag_dir)
            if rel != os.path.join(DIR, MANIFEST) and not n.startswith("."):
                files[rel] = os.path.getsize(path)
    with atomic_path(os.path.join(tag_dir, DIR, MANIFEST)) as tmp, open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=0, sort_keys=True)


def check_complete(tag_dir: str, flag: str = "--load") -> bool:
    """False for a tag without a layout-free part (older checkpoints); raises ConfigError naming the
    missing files when a rank's files are gone or truncated."""
    path = os.path.join(tag_dir, DIR, MANIFEST)
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(tag_dir, DIR)):
            raise ConfigError(f"{flag} {tag_dir}: the checkpoint is incomplete ({DIR}/{MANIFEST} is missing: "
                              "the save did not finish); load an earlier tag (--iteration / 'latest')")
        return False
    with open(path) as f:
        files = json.load(f)["files"]
    paths = {rel: os.path.join(tag_dir, rel) for rel in files}
    bad = [rel for rel, size in sorted(files.items())
           if not os.path.isfile(paths[rel]) or os.path.getsize(paths[rel]) != size]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ConfigError(f"{flag} {tag_dir}: the checkpoint is incomplete: {len(bad)} of {len(files)} files "
                          f"missing or truncated ({shown}); copy every rank's files or load another tag")
    return True


def read_state(tag_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(header, tensors) of ``state.safetensors``."""
    with safe_open(os.path.join(tag_dir, DIR, STATE), framework="pt") as f:
        header = json.loads(f.metadata()["megapost"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return header, tensors


def read_meta(directory: str, tag: str) -> dict[str, Any] | None:
    """``megapost_meta.json`` of ``directory/tag``, None when absent; a one-line error when unreadable."""
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
