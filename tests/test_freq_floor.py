"""Which frequency loss is Theorem 3.8's floor (named in the TensorBoard layout and docs/collapse_metrics.md):
freq_loss_seq. A row-constant head input gives one output distribution per sequence; the lowest
cross-entropy any such model reaches on a batch (each sequence's label frequencies, no perturbed
distribution doing better) is the mean of each sequence's own label entropy, below the pooled (agg) value."""

from __future__ import annotations

import torch
from collapse_metrics.frequency import aggregated_frequency_loss, per_sequence_frequency_loss
from collapse_metrics.tb_layout import custom_scalars_layout


def _ce(labels: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the labels under one distribution per sequence (q: [seqs or 1, vocab]) per trial."""
    return -torch.log(q.expand(labels.shape[0], -1)).gather(1, labels).mean()


def _best_row_constant_ce(labels: torch.Tensor, vocab: int, shared: bool, gen: torch.Generator) -> float:
    """The lowest cross-entropy of 2,000 random distributions (one per sequence, or ``shared`` by the batch)
    and of the label frequencies themselves (counted with bincount): Gibbs' inequality says they win."""
    rows = labels.reshape(1, -1) if shared else labels
    freq = torch.stack([torch.bincount(r, minlength=vocab) for r in rows]).double() / rows.shape[1]
    best = _ce(labels, freq.clamp_min(1e-300))
    for _ in range(2000):
        q = (freq + 0.05 * torch.rand(freq.shape, generator=gen, dtype=torch.float64)).clamp_min(1e-12)
        assert _ce(labels, q / q.sum(-1, keepdim=True)) >= best
    return float(best)


def test_per_sequence_frequency_loss_is_the_row_constant_floor() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 12
    skew = torch.rand(4, vocab, generator=gen) ** 4  # each sequence its own label distribution
    labels = torch.multinomial(skew, 64, replacement=True, generator=gen)
    per_seq = _best_row_constant_ce(labels, vocab, False, gen)
    pooled = _best_row_constant_ce(labels, vocab, True, gen)
    assert abs(per_sequence_frequency_loss(labels) - per_seq) < 1e-6
    assert abs(aggregated_frequency_loss(labels, vocab) - pooled) < 1e-6
    assert per_seq < pooled - 0.1  # the floor is the per-sequence value, not the pooled one


def test_layout_names_the_floor() -> None:
    titles = custom_scalars_layout((1, 2))["collapse"]
    (title,) = [t for t, (_, regexes) in titles.items() if "freq_loss/(agg|seq)" in regexes[0]]
    assert "seq: Theorem 3.8's floor" in title
