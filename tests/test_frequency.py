"""Frequency loss (Definition 3.7): hand-made entropies, brute force, masking, streaming, checkpointing."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from collapse_metrics.frequency import (
    RunningFrequencyLoss,
    aggregated_frequency_loss,
    entropy_from_counts,
    label_counts,
    per_sequence_entropies,
    per_sequence_frequency_loss,
    streaming_frequency_loss,
)

H31 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # [3:1] split


def brute_entropy(seq: list[int]) -> float:
    cnt = Counter(seq)
    n = len(seq)
    return -sum(c / n * math.log(c / n) for c in cnt.values()) if n else 0.0


def test_known_entropies_torch_and_numpy():
    for k in (1, 2, 7, 50):
        labels = torch.arange(k).repeat(3)
        assert aggregated_frequency_loss(labels, 64) == pytest.approx(math.log(k))
    assert aggregated_frequency_loss(torch.full((10,), 5), 8) == 0.0
    assert aggregated_frequency_loss(torch.tensor([4, 4, 4, 9]), 10) == pytest.approx(H31)
    assert entropy_from_counts(np.array([3, 1, 0, 0])) == pytest.approx(H31)
    assert float(entropy_from_counts(torch.tensor([0, 3, 0, 1]))) == pytest.approx(H31)
    batched = entropy_from_counts(np.array([[1, 1], [4, 0], [0, 0]]))
    np.testing.assert_allclose(batched, [math.log(2), 0.0, 0.0])
    assert isinstance(entropy_from_counts(torch.tensor([[1, 1]])), torch.Tensor)


def test_label_counts_and_errors():
    labels = torch.tensor([[1, 2, 2, -100], [0, 2, 5, 5]])
    assert label_counts(labels, 6).tolist() == [1, 1, 3, 0, 0, 2]
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    assert label_counts(labels, 6, mask).tolist() == [1, 1, 2, 0, 0, 1]
    assert label_counts(np.array([0, 3, 3], dtype=np.uint16), 4).tolist() == [1, 0, 0, 2]
    with pytest.raises(ValueError):
        label_counts(torch.tensor([0, 6]), 6)
    with pytest.raises(ValueError):
        label_counts(torch.tensor([0, -1]), 6)


def test_per_sequence_matches_counter_brute_force():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 13, (37, 50), generator=gen)
    mask = torch.rand(37, 50, generator=gen) > 0.3
    mask[5] = False  # an empty sequence is left out of the mean
    ent, n_valid = per_sequence_entropies(labels, mask)
    rows = [[int(v) for v, m in zip(r, mr, strict=True) if m] for r, mr in zip(labels, mask, strict=True)]
    expect = [brute_entropy(r) for r in rows]
    np.testing.assert_allclose(ent.numpy(), expect, atol=1e-12)
    assert n_valid.tolist() == [len(r) for r in rows]
    mean = np.mean([e for e, r in zip(expect, rows, strict=True) if r])
    assert per_sequence_frequency_loss(labels, mask) == pytest.approx(mean)
    big_vocab = labels * 1_000_003  # independent of the vocabulary size
    np.testing.assert_allclose(per_sequence_entropies(big_vocab, mask)[0].numpy(), expect, atol=1e-12)
    assert per_sequence_frequency_loss(torch.tensor([3, 3, 1, 3])) == pytest.approx(H31)
    assert math.isnan(per_sequence_frequency_loss(torch.full((2, 3), -100)))


def test_masking_equals_dropping():
    labels = torch.tensor([[7, 7, 7, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert aggregated_frequency_loss(labels, 8, mask) == pytest.approx(brute_entropy([7, 7, 7, 2] + [1] * 6))
    assert per_sequence_frequency_loss(labels, mask) == pytest.approx(H31 / 2)
    ignored = torch.where(mask, labels, torch.tensor(-100))
    assert per_sequence_frequency_loss(ignored) == pytest.approx(H31 / 2)


def test_running_equals_union_and_state_dict_roundtrip():
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 30, (4, 16), generator=gen) for _ in range(5)]
    masks = [torch.rand(4, 16, generator=gen) > 0.2 for _ in range(5)]
    run = RunningFrequencyLoss(30)
    for b, m in zip(batches[:3], masks[:3], strict=True):
        run.update(b, m)
    restored = RunningFrequencyLoss(30)
    restored.load_state_dict(run.state_dict())
    for b, m in zip(batches[3:], masks[3:], strict=True):
        run.update(b, m)
        restored.update(b, m)
    union, umask = torch.cat(batches), torch.cat(masks)
    assert run.value() == pytest.approx(aggregated_frequency_loss(union, 30, umask), abs=1e-12)
    assert run.per_sequence_value() == pytest.approx(per_sequence_frequency_loss(union, umask), abs=1e-12)
    assert run.num_tokens == int(umask.sum()) and run.num_sequences == 20
    assert restored.value() == run.value() and restored.per_sequence_value() == run.per_sequence_value()
    other = RunningFrequencyLoss(30)
    other.update(union, umask)
    half = RunningFrequencyLoss(30)
    half.update(union[:7], umask[:7])
    rest = RunningFrequencyLoss(30)
    rest.update(union[7:], umask[7:])
    half.merge(rest)
    assert torch.equal(half.counts, other.counts) and half.num_sequences == other.num_sequences
    with pytest.raises(ValueError):
        RunningFrequencyLoss(31).load_state_dict(run.state_dict())
    run.reset()
    assert run.value() == 0.0 and math.isnan(run.per_sequence_value())


def test_streaming_flat_and_2d():
    rng = np.random.default_rng(2)
    stream = rng.integers(0, 50, size=1000).astype(np.uint16)
    chunks = np.array_split(stream, 7)  # chunk edges do not align with sequences
    res = streaming_frequency_loss(iter(chunks), 50, seq_len=64)
    seqs = [stream[i:i + 64].tolist() for i in range(0, 1000, 64)]  # last one has 40 labels
    assert res.num_tokens == 1000 and res.num_sequences == len(seqs) == 16
    assert res.aggregated == pytest.approx(brute_entropy(stream.tolist()))
    assert res.per_sequence == pytest.approx(np.mean([brute_entropy(s) for s in seqs]))
    capped = streaming_frequency_loss(iter(chunks), 50, seq_len=64, max_tokens=300)
    assert capped.num_tokens == 300
    assert capped.aggregated == pytest.approx(brute_entropy(stream[:300].tolist()))
    assert capped.num_sequences == 5
    flat = streaming_frequency_loss(iter(chunks), 50)
    assert flat.aggregated == pytest.approx(res.aggregated) and math.isnan(flat.per_sequence)
    rows = stream[:960].reshape(-1, 48)
    chunks_2d = (torch.from_numpy(rows[i:i + 6].astype(np.int64)) for i in range(0, 20, 6))
    two_d = streaming_frequency_loss(chunks_2d, 50, max_tokens=500)
    assert two_d.num_tokens == 500 and two_d.num_sequences == 11  # 10 full rows + a 20-label row
    expect = [brute_entropy(r.tolist()) for r in rows[:10]] + [brute_entropy(rows[10, :20].tolist())]
    assert two_d.per_sequence == pytest.approx(np.mean(expect))
    assert two_d.aggregated == pytest.approx(brute_entropy(stream[:500].tolist()))
