"""Gradient reduction overlapped with backward (DP2 ZeRO-2, --overlap-grad-reduce, CPU/gloo): the first
bucket's reduction is launched while the blocks' backward is still running, and the losses equal one
process's."""

from __future__ import annotations

import pytest
from overlap_trace import trace

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs


def _last_micro_batch(events: list[str]) -> list[str]:
    """The events of the step's last micro-batch (its backward is where ZeRO reduces)."""
    ends = [i for i, e in enumerate(events) if e == "block0_backward_end"]
    start = ends[-2] + 1 if len(ends) > 1 else 0
    return events[start:ends[-1] + 1]


@pytest.mark.slow  # ~2.5 min on 2 cores
def test_zero2_reduces_during_backward(tiny_data) -> None:
    ref = trace(tiny_data, 1, ["--zero-stage", "2"])[0]
    ranks = trace(tiny_data, 2, ["--zero-stage", "2", "--overlap-grad-reduce"])
    for r, out in enumerate(ranks):
        last = _last_micro_batch(out["events"])
        comms = [i for i, e in enumerate(last) if not e.startswith("block")]
        blocks = {e: i for i, e in enumerate(last) if e.startswith("block")}
        print(f"rank {r} last micro-batch: {' '.join(last)}")
        assert comms, f"rank {r}: no reduction during the last micro-batch: {out['events']}"
        assert comms[0] < blocks["block0_backward_end"], f"rank {r}: first bucket after backward: {last}"
        assert sum(1 for i in comms if i < blocks["block0_backward_end"]) >= 2
    assert list(ranks[0]["losses"].values()) == pytest.approx(list(ref["losses"].values()), rel=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]
