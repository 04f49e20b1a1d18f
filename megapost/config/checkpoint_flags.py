"""Checkpoint flags: format, async save, retention, and Megatron-LM's load flags (``--finetune``,
``--no-load-optim``, ``--no-load-rng``) with Megatron's meaning."""

from __future__ import annotations

import argparse

from megapost.config.errors import ConfigError

FORMATS = ("megapost", "deepspeed", "torch", "torch_dist")
# Megatron's format names: megapost's own sharded format does what they are for
FORMAT_NOTES = {
    "torch": "megapost writes its sharded safetensors checkpoint (per-rank files, any-layout resume)",
    "torch_dist": "megapost writes its own sharded safetensors checkpoint instead of torch.distributed."
                  "checkpoint: per-rank parallel writes, any-layout resume, no pickle (docs/checkpoints.md)",
}


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint format, async save, retention, what --load restores")
    g.add_argument("--ckpt-format", dest="ckpt_format", choices=FORMATS, default="megapost",
                   help="megapost: one sharded safetensors copy (each rank writes its own shard); "
                        "deepspeed: DeepSpeed's own files as well (for zero_to_fp32 and DeepSpeed's tools); "
                        "torch / torch_dist (Megatron's names): megapost's format, noted at start")
    g.add_argument("--async-save", action="store_true",
                   help="copy the state to host memory, return to training and write in a background thread; "
                        "'latest' moves once the write is complete")
    g.add_argument("--save-retain", type=int, default=0,
                   help="keep only the newest N complete tags (0: keep all); never the one 'latest' names")
    g.add_argument("--save-retain-every", type=int, default=0,
                   help="with --save-retain: also keep every K-th save (tags whose iteration is a multiple "
                        "of K x --save-interval)")
    g.add_argument("--finetune", action="store_true",
                   help="--load only the weights: iteration, optimizer, scheduler, RNG and consumed "
                        "samples start fresh (Megatron's meaning)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="--load without the optimizer and scheduler state (Megatron's meaning)")
    g.add_argument("--no-load-rng", action="store_true", help="--load without the RNG state")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="--load the tag of this iteration instead of the one 'latest' names (Megatron's "
                        "meaning); tags of --save beyond it are set aside at start-up")


def require_load(args: argparse.Namespace, where: str = "") -> None:
    """The flags that say what --load restores need a --load (``where``: the run directory that gave
    none, for the message)."""
    for flag in ("finetune", "no_load_optim", "no_load_rng", "ckpt_step"):
        if getattr(args, flag) not in (False, None) and not args.load:
            found = f" ({where} holds no checkpoint yet)" if where else ""
            raise ConfigError(f"--{flag.replace('_', '-')} says what --load restores, but there is no "
                              f"--load{found}")


def check_checkpoint_arguments(args: argparse.Namespace) -> list[str]:
    """One-line errors for contradictions; returns the start-up notes."""
    for flag in ("save_retain", "save_retain_every"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    if args.save_retain_every and not args.save_retain:
        raise ConfigError("--save-retain-every needs --save-retain N (without it every tag is kept anyway)")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step {args.ckpt_step}: must be an iteration >= 0")
    if getattr(args, "run_name", None) is None:  # a named run's --load comes from its directory (later)
        require_load(args)
    notes = []
    if args.ckpt_format in FORMAT_NOTES:
        notes.append(f"--ckpt-format {args.ckpt_format} ({FORMAT_NOTES[args.ckpt_format]})")
    return notes
