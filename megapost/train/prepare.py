"""Before any process group forms: parse the flags and check everything that can be checked alike on
every rank (batch arithmetic, layout, data and tokenizer, checkpoints), so a bad run stops in one line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapost.checkpoint import data_identity, hf
from megapost.checkpoint.folder import CheckpointFolder
from megapost.checkpoint.format import read_meta
from megapost.checkpoint.layout import RunLayout, check_layout, check_save_dir
from megapost.config import launches
from megapost.config.arguments import parse_args, validate_args
from megapost.config.deepspeed_json import reconcile_with_user_config
from megapost.config.errors import ConfigError, Errors
from megapost.config.model_config import model_config_from_args
from megapost.data import IndexedDataset
from megapost.data.tokenizer import build_tokenizer
from megapost.data.tokenizer_sidecar import check_tokenizer_sidecar
from megapost.model import ModelConfig
from megapost.parallel import layout_errors
from megapost.plugin_api import plugin_classes
from megapost.runtime.cpu import set_threads
from megapost.runtime.distributed import check_backend, world_size_from_env
from megapost.runtime.run_dir import apply_named_run


@dataclass
class Prepared:
    """Validated flags, the model they describe, the user's DeepSpeed JSON and the plugin classes."""

    args: argparse.Namespace
    model: ModelConfig
    user_ds: dict[str, Any]
    plugin_classes: list[type]
    threads: str = ""  # the torch threads per rank, as the start line says them


def check_data(args: argparse.Namespace, tokenizer: Any) -> None:
    """Every source must have been tokenized with this tokenizer (its sidecar says so, see
    data/tokenizer_sidecar.py) or, without a sidecar, with a vocabulary this tokenizer covers."""
    say = print if os.environ.get("RANK", "0") == "0" else (lambda _line: None)  # once, not per rank
    for prefix in args.data_sources.prefixes:
        indexed = IndexedDataset(prefix)
        check_tokenizer_sidecar(prefix, tokenizer, len(indexed), indexed.num_tokens,
                                args.allow_tokenizer_mismatch, say)
        head = np.asarray(indexed.get(0, 0, min(int(indexed.sequence_lengths[0]), 1 << 20)))
        sample = [head] + [np.asarray(indexed[i]) for i in range(1, min(len(indexed), 64))]
        top = max(int(s.max()) for s in sample if s.size)
        if top >= tokenizer.vocab_size:
            raise ConfigError(
                f"--data-path {prefix} holds token id {top} but --tokenizer-model "
                f"{args.tokenizer_model} has only {tokenizer.vocab_size} tokens; re-tokenize the data with "
                "this tokenizer or pass the tokenizer it was built with"
            )


def apply_hf_flags(args: argparse.Namespace) -> None:
    """Fill the model flags from ``--load-hf``'s config.json (a parse-time mapping, as a preset's); a
    typed flag that disagrees is refused."""
    flags = hf.model_flags_from_hf(args.load_hf)
    args.hf_vocab_size = flags.pop("hf_vocab_size")
    for dest, value in flags.items():
        ours = getattr(args, dest, None)
        if dest in args.explicit and ours != value:
            raise ConfigError(f"--{dest.replace('_', '-')} {ours} disagrees with --load-hf {args.load_hf} "
                              f"({value}); drop the flag")
        setattr(args, dest, value)


def parse(argv: Sequence[str], errors: Errors | None = None) -> tuple[argparse.Namespace, list[type]]:
    """The flags (with --plugins' own) and the plugin classes; ``errors``: see ``parse_args``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins", default="")
    classes = plugin_classes(pre.parse_known_args(argv)[0].plugins)
    return parse_args(argv, classes, errors), classes


def check_flags(argv: Sequence[str], world_size: int) -> tuple[argparse.Namespace, list[type],
                                                                 dict[str, Any]]:
    """Parse and check every flag of ``argv``; all their errors raised together, one line each (unknown
    flags, refused values, a layout that does not fit, a backend this machine lacks, ...)."""
    errors = Errors()
    args, classes = parse(argv, errors)
    user_ds: dict[str, Any] = {}
    with errors:
        apply_named_run(args)  # --run-name: runs/<name>/..., resumed when it holds a checkpoint
        args.start_notes += [n for n in (launches.fresh_start(args),) if n] + launches.reconcile_resume(args)
    with errors:
        user_ds = reconcile_with_user_config(args)
    with errors:
        validate_args(args, world_size)
    with errors:
        check_backend(args.distributed_backend, "cuda" if torch.cuda.is_available() else "cpu")
    errors.raise_all()
    return args, classes, user_ds


def prepare(argv: Sequence[str], world_size: int | None = None) -> Prepared:
    """Parse and validate ``argv`` for a job of ``world_size`` ranks (default: the launcher's)."""
    world_size = world_size_from_env() if world_size is None else world_size
    args, classes, user_ds = check_flags(argv, world_size)
    threads = set_threads()  # before any heavy work: cores / local ranks unless OMP_NUM_THREADS
    if args.load_hf:  # the model flags come from its config.json
        apply_hf_flags(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    check_data(args, tokenizer)
    try:
        model_cfg = model_config_from_args(args, tokenizer.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    args.padded_vocab_size = model_cfg.vocab_size
    # every rank stops alike here, before any process group forms: a bad layout, or a checkpoint of
    # another layout or model, or unreadable/unsafe checkpoint files
    errors = layout_errors(model_cfg, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.sequence_parallel, args.seq_length, world_size)
    if errors:
        raise ConfigError("invalid parallel layout: " + "; ".join(errors))
    run = RunLayout.before_resolution(model_cfg, vars(args))  # resolution comes after the groups
    if args.load:
        resolved = CheckpointFolder(args.load).resolve(step=args.ckpt_step)
        check_layout(args.load, run, args.trust_checkpoint, args.ckpt_step)
        meta = read_meta(args.load, resolved.tag) or {}
        data_note = None if args.finetune else data_identity.check(
            os.path.join(args.load, resolved.tag), meta.get("data"),
            data_identity.of(args.data_sources.prefixes), args.override_data)
        args.start_notes += [n for n in (resolved.note, data_note) if n]
    check_save_dir(args.save, run.shape)
    return Prepared(args, model_cfg, user_ds, classes, threads)
