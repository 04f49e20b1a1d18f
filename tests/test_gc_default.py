"""Python's gc is managed on a CUDA run by default (issue 38: automatic gc pauses hit every rank at a
different step); ``--no-manual-gc`` keeps the automatic collector, a CPU run is unchanged."""

from __future__ import annotations

import argparse

import pytest

from megapost.config import megatron_habits as habits


def resolve(argv: list[str], cuda: bool, monkeypatch) -> tuple[argparse.Namespace, list[str]]:
    from megapost.config.arguments import parse_args

    monkeypatch.setattr(habits, "_cuda", lambda: cuda)
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", *argv])
    return args, args.megatron_notes


@pytest.mark.parametrize(("argv", "cuda", "on", "interval"), [
    ([], True, True, habits.GPU_GC_INTERVAL),
    ([], False, False, 0),
    (["--no-manual-gc"], True, False, 0),
    (["--manual-gc-interval", "7"], True, True, 7),
    (["--manual-gc"], False, True, 0),
])
def test_gc_is_managed_on_cuda_unless_refused(argv, cuda, on, interval, monkeypatch) -> None:
    args, notes = resolve(argv, cuda, monkeypatch)
    assert bool(args.manual_gc) is on and args.manual_gc_interval == interval
    assert any("gc" in n for n in notes) is (on or "--no-manual-gc" in argv)  # a start-up note either way
