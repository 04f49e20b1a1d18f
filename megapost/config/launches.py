"""Every launch of a run, kept in ``args.json``; a resume reuses the saved data settings not typed
again (whether the data is the tag's own is checked against the tag: megapost.checkpoint.data_identity).

``args.json`` (in the TensorBoard directory, and in ``--save`` so ``--load`` alone finds it) holds the
latest launch's typed config, one object per section (``model``, ``optimizer``, ...; ``plugins``: each
plugin's own; megapost.config.resolved), ``format`` 2, and ``launches``: every launch, oldest first, each
with its time, command line, data and schedule settings. A run from before (no ``format``) has every flag
by name at the top level instead; both are read (``read_launches``; analysis reads a section's field or
the flat flag).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ARGS_JSON = "args.json"
RECORD_FORMAT = 2  # the sections; before it (no "format"): every flag by name, flat
DATA_KEYS = ("data_path", "split", "tokenizer_type", "tokenizer_model", "vocab_size", "train_data_path",
             "valid_data_path", "test_data_path", "data_args_path", "per_split_data_args_path")
SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "train_iters",
                 "lr_wsd_decay_iters", "lr_wsd_decay_style")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _norm(value: Any) -> Any:
    """Paths compared absolute; numbers in a blend as given."""
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, str) and (os.sep in value or os.path.exists(value)):
        return os.path.abspath(value)
    return value


def data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The data/tokenizer flags as given (before validation rewrites ``data_path``)."""
    return {k: _norm(getattr(args, k, None)) for k in DATA_KEYS}


def read_launches(directory: str | None) -> list[dict[str, Any]]:
    """The launch history in ``directory/args.json`` (empty when absent or unreadable)."""
    if not directory:
        return []
    try:
        with open(os.path.join(directory, ARGS_JSON)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return []
    return saved.get("launches", []) if isinstance(saved, dict) else []


def previous_launches(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What the resumed run recorded: ``--load``'s args.json, else the TensorBoard directory's."""
    return read_launches(args.load) or read_launches(getattr(args, "tensorboard_dir", None))


def reconcile_resume(args: argparse.Namespace) -> list[str]:
    """A run with a launch history (``--load``'s args.json, else the TensorBoard directory's, e.g. a
    ``--run-name`` interrupted before its first checkpoint): untyped data flags take the recorded values
    (typed ones are checked against the tag's data identity later). Resuming (``--load`` set), changed
    schedule flags are noted. Returns the start-up notes."""
    args.launch_history = previous_launches(args)
    args.launch_data = data_settings(args)
    if not args.launch_history:
        return []
    last = args.launch_history[-1]
    saved, notes = last.get("data", {}), []
    for key in DATA_KEYS:
        if key in saved and key not in args.explicit:
            setattr(args, key, saved[key])
    args.launch_data = data_settings(args)
    if not args.load:
        return ["no checkpoint in this run yet: it starts over from iteration 0 with the data it recorded"]
    schedule = [f"{_flag(k)} {last['schedule'][k]} -> {getattr(args, k)}" for k in SCHEDULE_KEYS
                if k in last.get("schedule", {}) and last["schedule"][k] != getattr(args, k)]
    if schedule:
        notes.append(f"schedule changed since the last launch ({'; '.join(schedule)}): the new schedule "
                     "sets the lr from the resumed iteration on")
    return notes


def fresh_start(args: argparse.Namespace) -> str | None:
    """Megatron's ``--save X --load X`` on a first launch: X has no checkpoint yet, so start fresh."""
    if not args.load or not args.save or os.path.abspath(args.load) != os.path.abspath(args.save):
        return None
    if os.path.isfile(os.path.join(args.load, "latest")):
        return None
    args.load = None
    return f"--load {args.save}: no checkpoint there yet; starting a new run that saves to it (as Megatron)"


def launch_entry(args: argparse.Namespace) -> dict[str, Any]:
    """This launch's entry in ``launches``: time, command line, data and schedule settings as given."""
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
            "data": getattr(args, "launch_data", data_settings(args)),
            "schedule": {k: getattr(args, k, None) for k in SCHEDULE_KEYS}}


def record(args: argparse.Namespace, sections: dict[str, Any]) -> dict[str, Any]:
    """args.json's content: the typed config's ``sections`` (megapost.config.resolved.Config.to_json) and
    the launch history with this launch appended."""
    return {"format": RECORD_FORMAT, **sections,
            "launches": [*getattr(args, "launch_history", []), launch_entry(args)]}


def write_record(args: argparse.Namespace, directories: list[str | None], sections: dict[str, Any]) -> None:
    """Rank 0: args.json (atomically) into each directory of ``directories``."""
    from megapost.utils.atomic import atomic_write_text

    text = json.dumps(record(args, sections), indent=1, default=str)
    for directory in {d for d in directories if d}:
        os.makedirs(directory, exist_ok=True)
        atomic_write_text(os.path.join(directory, ARGS_JSON), text)
