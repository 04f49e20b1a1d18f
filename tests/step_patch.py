"""Train through megapost's build path with ``StepRunner.train_step`` wrapped (the traces and counts of
one step in tests/comm_count.py and tests/bf16_overlap_trace.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def train_with_step(argv: list[str], step: Callable[[Any, Callable[..., Any], int], Any]) -> tuple[Any, Any]:
    """Train ``argv`` with every ``StepRunner.train_step(self, n)`` call routed to
    ``step(self, original, n)``; returns (the closed trainer, its history)."""
    from megapost.train.build import build
    from megapost.train.prepare import prepare
    from megapost.train.step import StepRunner

    original = StepRunner.train_step
    StepRunner.train_step = lambda self, n: step(self, original, n)  # type: ignore[method-assign]
    try:
        trainer = build(prepare(argv))
        try:
            history = trainer.train()
        finally:
            trainer.close()
    finally:
        StepRunner.train_step = original  # type: ignore[method-assign]
    return trainer, history
