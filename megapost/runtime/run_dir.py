"""Run directories: every run gets ``<runs-dir>/<run-name>/{tensorboard,checkpoints}`` of its own.

A named run that already holds a checkpoint is resumed (Megatron's habit of ``--load`` = ``--save``);
an unnamed run gets a fresh ``<norm>norm-<YYYYmmdd-HHMMSS>`` directory, picked by global rank 0 and
broadcast so every rank (every node) agrees. ``<runs-dir>/latest`` is a symlink to the newest run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch.distributed as dist

from megapost.config.errors import ConfigError

LATEST_LINK = "latest"


def _check_name(name: str) -> None:
    if not name or name in (".", "..", LATEST_LINK) or os.sep in name:
        raise ConfigError(f"--run-name {name!r}: use a plain directory name (not '{LATEST_LINK}', no '/')")


def _use(args: argparse.Namespace, run_dir: str) -> None:
    """Point --save/--tensorboard-dir into ``run_dir`` unless typed; resume its checkpoint if any."""
    if "save" not in args.explicit:
        args.save = os.path.join(run_dir, "checkpoints")
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
    """``runs_dir/latest`` -> ``name``, replaced atomically."""
    tmp = os.path.join(runs_dir, f".{LATEST_LINK}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, os.path.join(runs_dir, LATEST_LINK))


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
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        link_latest(args.runs_dir, args.run_name)
        state = f"resuming {args.load}" if args.load else "new run"
        print(f" run directory: {os.path.abspath(args.run_dir)} ({state})", flush=True)
