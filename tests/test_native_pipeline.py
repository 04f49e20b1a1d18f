"""megapost.native.pipeline: megapost's model cut into pipeline chunks and run by torch.distributed.pipelining
on 2 gloo ranks, the interleaved schedule (2 virtual chunks per rank) against plain 1F1B and against the
unpipelined model in one process."""

from __future__ import annotations

import pytest
from dist_utils import max_rel_diff, run_ranks
from pipeline_train import pipeline_losses, reference_losses


def test_chunks_follow_megatrons_order() -> None:
    from megapost.native.pipeline import chunk_indices

    assert chunk_indices(8, 2, 2, 0) == [(0, 0, 2), (2, 4, 6)]
    assert chunk_indices(8, 2, 2, 1) == [(1, 2, 4), (3, 6, 8)]
    assert chunk_indices(4, 2, 1, 1) == [(1, 2, 4)]
    with pytest.raises(ValueError, match="equal chunks"):
        chunk_indices(6, 2, 2, 0)


@pytest.mark.integration
def test_interleaved_equals_1f1b_and_the_unpipelined_model() -> None:
    """PP 2, 4 micro-batches, AdamW, 3 steps: the interleaved schedule's losses equal 1F1B's bit for bit
    (each chunk sees the same micro-batches in the same order; only the interleaving differs) and the
    one-process model's bit for bit (the pipeline scales the accumulated gradients by 1/4, the one-process
    run each micro-batch's: exact either way);
    rank 0 ran its two chunks interleaved (stage 2's first forward before stage 0's last)."""
    one = run_ranks(pipeline_losses, 2, 1)
    inter = run_ranks(pipeline_losses, 2, 2)
    ref = reference_losses()
    print("1F1B", one[1]["losses"], "\ninterleaved", inter[1]["losses"], "\none process", ref)
    assert inter[1]["losses"] == one[1]["losses"]
    assert one[1]["losses"] == ref, max_rel_diff(one[1]["losses"], ref)
    order = inter[0]["forward_order"]
    assert sorted(set(order)) == [0, 2] and order.index(2) < len(order) - 1 - order[::-1].index(0), order
