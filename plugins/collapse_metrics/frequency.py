"""Frequency loss (Definition 3.7 / Theorem 3.8): L_freq = H(p_freq) = -sum_v p_v log p_v, p = c / N, nats.

Aggregated: entropy of the label counts pooled over a scope. Per-sequence: mean over sequences of the
entropy of each sequence's own label counts. Labels equal to ``ignore_index`` or where ``mask`` is
False are excluded everywhere; sequences with no valid label are left out of per-sequence means.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
ArrayLike = torch.Tensor | np.ndarray


def _as_long(labels: ArrayLike) -> torch.Tensor:
    if isinstance(labels, torch.Tensor):
        return labels.long()
    return torch.from_numpy(np.asarray(labels).astype(np.int64, copy=False))


def _valid(labels: torch.Tensor, mask: ArrayLike | None, ignore_index: int | None) -> torch.Tensor:
    valid = torch.ones_like(labels, dtype=torch.bool)
    if mask is not None:
        valid &= torch.as_tensor(mask, device=labels.device).bool()
    if ignore_index is not None:
        valid &= labels != ignore_index
    return valid


def label_counts(labels: ArrayLike, vocab_size: int, mask: ArrayLike | None = None,
                 ignore_index: int | None = IGNORE_INDEX) -> torch.Tensor:
    """Counts c_v (int64, length ``vocab_size``) of the valid labels, any shape."""
    labels = _as_long(labels)
    kept = labels[_valid(labels, mask, ignore_index)]
    if kept.numel() and int(kept.min()) < 0:
        raise ValueError("negative label that is neither masked nor ignore_index")
    counts = torch.bincount(kept, minlength=vocab_size)
    if counts.numel() > vocab_size:
        raise ValueError(f"label {counts.numel() - 1} out of range for vocab_size {vocab_size}")
    return counts


def entropy_from_counts(counts: ArrayLike) -> ArrayLike:
    """H = -sum_v p_v log p_v, p = c / sum(c), over the last axis, nats, 0 log 0 = 0 (and H = 0 if N = 0).

    Returns float64 of the input's kind (torch tensor or numpy array/scalar).
    """
    if isinstance(counts, torch.Tensor):
        c = counts.double()
        p = c / c.sum(-1, keepdim=True).clamp_min(1.0)
        return -torch.special.xlogy(p, p).sum(-1)
    c = np.asarray(counts, dtype=np.float64)
    p = c / np.maximum(c.sum(-1, keepdims=True), 1.0)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def aggregated_frequency_loss(labels: ArrayLike, vocab_size: int, mask: ArrayLike | None = None,
                              ignore_index: int | None = IGNORE_INDEX) -> float:
    """Entropy of the pooled label counts of every sequence in ``labels``."""
    return float(entropy_from_counts(label_counts(labels, vocab_size, mask, ignore_index)))


def per_sequence_entropies(labels: ArrayLike, mask: ArrayLike | None = None,
                           ignore_index: int | None = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy of each row's own label counts, [b] float64, and the valid count per row, [b] int64.

    Sort-based, O(b s log s) and independent of the vocabulary: sort each row, find runs of equal
    labels, and accumulate -p log p of each run (p = run length / valid count) into its row.
    A 1-D input is one sequence.
    """
    labels = _as_long(labels)
    if labels.dim() == 1:
        labels = labels[None]
        mask = None if mask is None else torch.as_tensor(mask)[None]
    b, s = labels.shape
    valid = _valid(labels, mask, ignore_index)
    if bool(((labels < 0) & valid).any()):
        raise ValueError("negative label that is neither masked nor ignore_index")
    n_valid = valid.sum(1)
    if b * s == 0:
        return torch.zeros(b, dtype=torch.float64, device=labels.device), n_valid
    keys = torch.sort(torch.where(valid, labels, -1), dim=1).values.reshape(-1)  # -1 marks invalid
    start = torch.ones(b, s, dtype=torch.bool, device=labels.device)
    start[:, 1:] = keys.view(b, s)[:, 1:] != keys.view(b, s)[:, :-1]
    start = start.reshape(-1)
    run_len = torch.bincount(torch.cumsum(start, 0) - 1)
    run_row = torch.div(torch.nonzero(start).squeeze(1), s, rounding_mode="floor")
    keep = keys[start] >= 0
    row = run_row[keep]
    p = run_len[keep].double() / n_valid[row].double()
    ent = torch.zeros(b, dtype=torch.float64, device=labels.device)
    ent.index_add_(0, row, -torch.special.xlogy(p, p))
    return ent, n_valid


def per_sequence_frequency_loss(labels: ArrayLike, mask: ArrayLike | None = None,
                                ignore_index: int | None = IGNORE_INDEX) -> float:
    """Mean over sequences (rows with >= 1 valid label) of each sequence's own label entropy; nan if none."""
    ent, n_valid = per_sequence_entropies(labels, mask, ignore_index)
    used = n_valid > 0
    return float(ent[used].mean()) if bool(used.any()) else math.nan


class RunningFrequencyLoss:
    """Pooled label counts accumulated over ``update`` calls (plus a running per-sequence mean).

    ``counts`` is additive, so shards/ranks combine by summing (``merge`` or an all-reduce of the
    tensors in ``state_dict``).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 ignore_index: int | None = IGNORE_INDEX) -> None:
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.counts = torch.zeros(vocab_size, dtype=torch.int64, device=device)
        self.seq_entropy_sum = 0.0
        self.num_sequences = 0

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    def update(self, labels: ArrayLike, mask: ArrayLike | None = None) -> None:
        """Add the valid labels of ``labels`` ([..., s], rows are sequences; 1-D is one sequence)."""
        labels = _as_long(labels)
        counts = label_counts(labels, self.vocab_size, mask, self.ignore_index)
        self.counts += counts.to(self.counts.device)
        if labels.dim() > 2:
            labels = labels.reshape(-1, labels.shape[-1])
            mask = None if mask is None else torch.as_tensor(mask).reshape(labels.shape)
        ent, n_valid = per_sequence_entropies(labels, mask, self.ignore_index)
        self.seq_entropy_sum += float(ent.sum())
        self.num_sequences += int((n_valid > 0).sum())

    def value(self) -> float:
        """Aggregated frequency loss of everything seen so far (0 if nothing)."""
        return float(entropy_from_counts(self.counts))

    def per_sequence_value(self) -> float:
        """Mean per-sequence frequency loss so far (nan if no sequence)."""
        return self.seq_entropy_sum / self.num_sequences if self.num_sequences else math.nan

    def merge(self, other: RunningFrequencyLoss) -> None:
        """Add another accumulator's state (e.g. another shard's)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError("vocab_size mismatch")
        self.counts += other.counts.to(self.counts.device)
        self.seq_entropy_sum += other.seq_entropy_sum
        self.num_sequences += other.num_sequences

    def reset(self) -> None:
        self.counts.zero_()
        self.seq_entropy_sum, self.num_sequences = 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "counts": self.counts.detach().cpu().clone(),
                "seq_entropy_sum": self.seq_entropy_sum, "num_sequences": self.num_sequences}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["vocab_size"]) != self.vocab_size:
            raise ValueError(f"vocab_size {state['vocab_size']} != {self.vocab_size}")
        self.counts = torch.as_tensor(state["counts"], dtype=torch.int64).to(self.counts.device).clone()
        self.seq_entropy_sum = float(state["seq_entropy_sum"])
        self.num_sequences = int(state["num_sequences"])


@dataclass(frozen=True)
class FrequencyLossResult:
    aggregated: float  # nats, pooled over every label consumed
    per_sequence: float  # nats, mean over sequences (nan when sequences are undefined)
    num_tokens: int
    num_sequences: int


def streaming_frequency_loss(token_iterator: Iterable[ArrayLike], vocab_size: int, seq_len: int | None = None,
                             max_tokens: int | None = None,
                             ignore_index: int | None = IGNORE_INDEX) -> FrequencyLossResult:
    """Frequency losses of a label stream, consumed chunk by chunk in O(vocab_size + chunk) memory.

    A 2-D chunk [b, s] holds b sequences. 1-D chunks are pieces of one flat stream: with ``seq_len``
    it is cut into consecutive sequences of ``seq_len`` labels (carried across chunks; a shorter tail
    is the last sequence); without it only the aggregated value is defined (per_sequence = nan).
    ``max_tokens`` stops after that many labels (the row it cuts becomes a shorter sequence).
    """
    run = RunningFrequencyLoss(vocab_size, ignore_index=ignore_index)
    carry = torch.zeros(0, dtype=torch.int64)
    consumed = 0
    flat_without_seq = False
    for chunk in token_iterator:
        x = _as_long(chunk).cpu()
        if max_tokens is not None:
            budget = max_tokens - consumed
            if budget <= 0:
                break
            consumed += min(budget, x.numel())
            if x.numel() > budget and x.dim() == 1:
                x = x[:budget]
            elif x.numel() > budget:
                x = x.reshape(-1, x.shape[-1])
                full, rest = divmod(budget, x.shape[1])
                if rest:
                    run.update(x[full, :rest])
                x = x[:full]
        if x.dim() >= 2:
            run.update(x.reshape(-1, x.shape[-1]))
        elif seq_len is None:
            flat_without_seq = True
            run.counts += label_counts(x, vocab_size, ignore_index=ignore_index)
        else:
            x = torch.cat([carry, x])
            full = (x.numel() // seq_len) * seq_len
            if full:
                run.update(x[:full].view(-1, seq_len))
            carry = x[full:].clone()
    if carry.numel():
        run.update(carry)
    per_seq = math.nan if flat_without_seq else run.per_sequence_value()
    return FrequencyLossResult(run.value(), per_seq, run.num_tokens, run.num_sequences)
