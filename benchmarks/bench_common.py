"""What the benchmarks share: model-size flags, synthetic batches, and megapost's real Trainer from the
one build path (megapost.train.build) in this one process, fed synthetic batches."""

from __future__ import annotations

import argparse
import atexit
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megapost.data import IndexedDatasetBuilder, best_dtype
from megapost.model import ModelConfig
from megapost.train.build import DataSource, build
from megapost.train.prepare import Prepared, prepare
from megapost.train.trainer import Trainer


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)


def synthetic_batches(vocab: int, micro: int, seq: int) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(micro, seq)}


def _placeholder_data(vocab: int, seq: int) -> str:
    """A two-document .bin/.idx (for validation only: the batches are synthetic), removed at exit."""
    tmp = tempfile.TemporaryDirectory(prefix="megapost-bench-")
    atexit.register(tmp.cleanup)
    prefix = str(Path(tmp.name) / "placeholder")
    with IndexedDatasetBuilder(prefix, best_dtype(vocab)) as builder:
        for doc in range(2):
            builder.add_document(torch.randint(0, vocab - 1, (seq + 1,),
                                               generator=torch.Generator().manual_seed(doc)).tolist())
    return prefix


def build_trainer(b: argparse.Namespace, extra_flags: Sequence[str] = (), plugin_classes: Sequence[type] = (),
                  tb_dir: str | None = None, world_size: int = 1) -> tuple[Trainer, ModelConfig, Any]:
    """megapost's Trainer (real engine, hooks and plugins) on synthetic batches; returns it, the
    model config and args (``world_size`` > 1: this process is one data-parallel rank of a launch)."""
    argv = ["--num-layers", str(b.layers), "--hidden-size", str(b.hidden), "--ffn-hidden-size",
            str(3 * b.hidden), "--seq-length", str(b.seq), "--micro-batch-size", str(b.micro),
            "--global-batch-size", str(b.micro * b.accum * world_size), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(b.vocab), "--data-path", _placeholder_data(b.vocab, b.seq), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--peak-tflops", "1", *extra_flags,
            *(["--tensorboard-dir", tb_dir] if tb_dir else [])]
    prep = prepare(argv, world_size=world_size)
    prep = Prepared(prep.args, prep.model, prep.user_ds, list(plugin_classes) or prep.plugin_classes)
    cfg = prep.model
    batches = DataSource(lambda _consumed: synthetic_batches(cfg.vocab_size, b.micro, b.seq), lambda: None)
    trainer = build(prep, data=batches)
    print(f"model {cfg.num_parameters() / 1e6:.1f}M params, {b.layers}x{b.hidden}, seq {b.seq}, "
          f"batch {b.micro}x{b.accum}, threads {torch.get_num_threads()}")
    return trainer, cfg, prep.args
