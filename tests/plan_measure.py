"""Measured vs planned peak memory per rank: the real trainer (DeepSpeed engine) at one layout, with
every tensor allocation counted by ``LiveTensorMemory`` (``MEGAPOST_TENSOR_MEMORY=1``)."""

from __future__ import annotations

import os
from typing import Any

from dist_utils import run_ranks

# 4 layers, d 256, seq 256, vocab padded to 4096: states and activations are MB-scale.
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "768",
         "--num-attention-heads", "4", "--seq-length", "256", "--make-vocab-size-divisible-by", "4096"]


def _tracked() -> None:
    os.environ["MEGAPOST_TENSOR_MEMORY"] = "1"


def _train(argv: list[str]) -> dict[str, Any]:
    from megapost.pretrain import run

    return run(argv)["memory"]


def measure(data: Any, world: int, flags: list[str], ds_config: str | None = None) -> list[dict[str, Any]]:
    """Every rank's {measured_bytes, planned_bytes, measured_as} after 2 steps of the real trainer."""
    argv = ["--data-path", str(data.prefix), "--tokenizer-model", str(data.tokenizer_model), *MODEL,
            "--train-iters", "2", "--log-interval", "2", "--eval-interval", "0", "--peak-tflops", "1",
            "--lr-warmup-iters", "1", *flags]
    if ds_config:
        argv += ["--deepspeed_config", ds_config]
    return run_ranks(_train, world, argv, setup=_tracked, timeout=900)
