"""Run directories: every run gets ``<runs-dir>/<run-name>/{tensorboard,checkpoints}`` of its own.

A named run that already holds a checkpoint is resumed (Megatron's habit of ``--load`` = ``--save``);
an unnamed run gets a fresh ``<norm>norm-<YYYYmmdd-HHMMSS>`` directory, picked by global rank 0 and
broadcast so every rank (every node) agrees. ``<runs-dir>/latest`` is a one-line file naming the newest
run (a file, not a symlink: ``tensorboard --logdir runs`` would show a symlink as a second copy of the run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch.distributed as dist

from megapost.config.checkpoint_flags import require_load
from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_write_text

LATEST_LINK = "latest"


def _check_name(name: str) -> None:
    if not name or name in (".", "..", LATEST_LINK) or os.sep in name:
        raise ConfigError(f"--run-name {name!r}: use a plain directory name (not '{LATEST_LINK}', no '/')")


def _use(args: argparse.Namespace, run_dir: str) -> None:
    """Point --save/--tensorboard-dir into ``run_dir`` unless typed; resume its checkpoint if any."""
    if "save" not in args.explicit:
        args.save = os.path.join(run_dir, "checkpoints")
        args.save_in_run_dir = True  # not typed: said once at start-up, with the size (train.build)
    if "tensorboard_dir" not in args.explicit:
        args.tensorboard_dir = os.path.join(run_dir, "tensorboard")
    if "load" not in args.explicit and args.save and os.path.isfile(os.path.join(args.save, "latest")):
        args.load = args.save
    args.run_dir = run_dir


def apply_named_run(args: argparse.Namespace) -> None:
    """Before any process group exists: a given --run-name is the same on every rank."""
    args.run_dir = None
    if args.run_name is None:
        return
    _check_name(args.run_name)
    args.runs_dir = args.runs_dir or "runs"
    _use(args, os.path.join(args.runs_dir, args.run_name))
    require_load(args, f"--run-name {args.run_name}: {args.save}")  # e.g. --ckpt-step of the named run


def _new_run_dir(runs_dir: str, base: str) -> str:
    """Create ``runs_dir/base`` (or ``base-2``, ...): never an existing directory."""
    os.makedirs(runs_dir, exist_ok=True)
    for k in range(1, 1000):
        name = base if k == 1 else f"{base}-{k}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.join(runs_dir, name))
            return name
    raise ConfigError(f"--runs-dir {runs_dir}: cannot create a new run directory {base}-N")


def link_latest(runs_dir: str, name: str) -> None:
    """``runs_dir/latest``: a file holding ``name``, replaced atomically (an old symlink included)."""
    path = os.path.join(runs_dir, LATEST_LINK)
    if os.path.islink(path):
        os.unlink(path)
    atomic_write_text(path, name + "\n")


def latest_run(runs_dir: str) -> str | None:
    """The newest run's directory named by ``runs_dir/latest`` (None when there is none)."""
    path = os.path.join(runs_dir, LATEST_LINK)
    try:
        if os.path.islink(path):  # written by an older megapost
            return os.path.realpath(path)
        with open(path) as f:
            name = f.read().strip()
    except OSError:
        return None
    return os.path.join(runs_dir, name) if name else None


def resolve_default_run(args: argparse.Namespace) -> None:
    """After torch.distributed starts: an unnamed run under --runs-dir gets a new directory, named by
    global rank 0 and broadcast to all ranks; rank 0 prints it and moves ``latest``."""
    if not args.runs_dir:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.run_name is None:
        base = f"{args.norm_position}norm-{time.strftime('%Y%m%d-%H%M%S')}"
        chosen = [_new_run_dir(args.runs_dir, base) if rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(chosen, src=0)
        args.run_name = chosen[0]
        _use(args, os.path.join(args.runs_dir, args.run_name))
    inside = [d for d in (args.save, args.tensorboard_dir)
              if d and os.path.abspath(d).startswith(os.path.abspath(args.run_dir) + os.sep)]
    if rank == 0 and not inside:  # --save and --tensorboard-dir elsewhere: no empty run directory
        with contextlib.suppress(OSError):
            os.rmdir(args.run_dir)
        print(f" run directory: none (--save and --tensorboard-dir are elsewhere: {args.save}, "
              f"{args.tensorboard_dir})", flush=True)
        return
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        link_latest(args.runs_dir, args.run_name)
        state = f"resuming {args.load}" if args.load else "new run"
        print(f" run directory: {os.path.abspath(args.run_dir)} ({state})", flush=True)
