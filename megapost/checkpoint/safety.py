"""Checkpoint files that cannot run code, and one-line errors for unreadable or unwritable ones.

DeepSpeed reads every checkpoint file (model states with megapost's client state, ZeRO optimizer
shards, pipeline layer files) through ``engine.checkpoint_engine``. :class:`SafeCheckpointEngine`
replaces DeepSpeed's engine there: it unpickles with ``torch.load(weights_only=True)`` and admits only
the few DeepSpeed classes its own optimizer shards hold (:data:`ALLOWED_GLOBALS`, found with
``torch.serialization.get_unsafe_globals_in_checkpoint`` on real ZeRO-0/1/2, bf16 and pipeline
checkpoints). ``--trust-checkpoint`` restores DeepSpeed's unrestricted (code-running) loader.
Writes go through a Python file object, so a full disk surfaces as ``OSError(ENOSPC)`` naming the file
instead of C++'s ``basic_ios::clear: iostream error``.
"""

from __future__ import annotations

import errno
import glob
import os
import pickle
import re
from typing import Any

import torch

from megapost.config.errors import ConfigError
from megapost.ds_adapter.internals import CHECKPOINT_GLOBALS, CheckpointEngineBase, engine_config

ALLOWED_GLOBALS: tuple[type, ...] = CHECKPOINT_GLOBALS  # DeepSpeed's classes in its files for megapost
TRUST_HINT = ("pass --trust-checkpoint only if you trust whoever wrote it (unpickling a crafted file "
              "runs arbitrary code)")
_SPACE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                 errno.EFBIG: "file size limit reached"}


def _allowed_names() -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in ALLOWED_GLOBALS}


def unsafe_error(path: str, detail: str) -> ConfigError:
    found = re.search(r"GLOBAL (\S+)", detail)
    what = f"the global {found.group(1)}" if found else "content"
    return ConfigError(f"checkpoint file {path} holds {what}, which megapost's safe loader does not "
                       f"allow, so it was not loaded; {TRUST_HINT}")


def corrupt_error(path: str, detail: str) -> ConfigError:
    reason = detail.strip().splitlines()[0] if detail.strip() else "unreadable"
    reason = reason.split(". This is an internal")[0]
    return ConfigError(f"checkpoint file {path} is truncated or corrupt ({reason}); resume from another "
                       "tag (write its name into 'latest') or save a new checkpoint")


def load_file(path: str, map_location: Any = None, trust: bool = False) -> Any:
    """``torch.load`` one checkpoint file, refusing (one line) globals outside the allowlist."""
    try:
        if trust:
            return torch.load(path, map_location=map_location, weights_only=False)
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust and "Weights only load failed" in str(e):
            raise unsafe_error(path, str(e)) from None
        raise corrupt_error(path, str(e)) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise corrupt_error(path, str(e)) from None


def scan_files(tag_dir: str, trust: bool = False) -> None:
    """Before anything is loaded (on every rank alike): each ``.pt`` file of the tag must be a complete
    archive whose pickle names only allowed globals. Reads pickle opcodes; executes nothing."""
    allowed = _allowed_names()
    for path in sorted(glob.glob(os.path.join(tag_dir, "*.pt"))):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            raise corrupt_error(path, str(e)) from None
        bad = [n for n in names if n not in allowed]
        if bad and not trust:
            raise unsafe_error(path, f"GLOBAL {bad[0]}")


def mount_point(path: str) -> str:
    """``/mount (device)`` of the filesystem holding ``path``."""
    mount = os.path.abspath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    device = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 1 and parts[1] == mount:
                    device = parts[0]
    except OSError:
        pass
    return f"{mount} ({device})" if device else mount


def write_error(e: OSError, fallback_path: str, last_complete: str | None) -> ConfigError | None:
    """The one-line error for a save that hit a full disk / quota / file-size limit (None otherwise)."""
    if e.errno not in _SPACE_ERRNOS:
        return None
    path = e.filename or fallback_path
    return ConfigError(f"{_SPACE_ERRNOS[e.errno]} on {mount_point(os.path.dirname(path) or '.')} writing "
                       f"{path}; the last complete checkpoint is {last_complete or 'none'}")


class SafeCheckpointEngine(CheckpointEngineBase):
    """DeepSpeed's torch checkpoint engine with a weights-only loader and errno-preserving writes."""

    def __init__(self, config_params: Any = None, trust: bool = False) -> None:
        super().__init__(config_params)
        self.name = "MegapostSafeCheckpointEngine"
        self.trust = trust

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_file(path, map_location=map_location, trust=self.trust)

    def save(self, state_dict: Any, path: str) -> None:
        try:
            with open(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
        except (OSError, RuntimeError) as e:
            cause = os_error_behind(e, path)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, path) from e


def os_error_behind(e: BaseException, path: str) -> OSError | None:
    """The ``OSError`` behind a failed write (torch's zip writer re-raises it as a ``RuntimeError``), or
    ENOSPC when the filesystem has no free blocks left."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    try:
        if os.statvfs(os.path.dirname(path) or ".").f_bavail == 0:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    except OSError:
        pass
    return None


def install(engine: Any, trust: bool = False) -> SafeCheckpointEngine:
    """Make ``engine`` (plain or pipeline; its module's layer files go through it too) save and load
    through :class:`SafeCheckpointEngine`. Call right after ``deepspeed.initialize``."""
    engine.checkpoint_engine = SafeCheckpointEngine(engine_config(engine), trust=trust)
    return engine.checkpoint_engine
