"""Pure index builders behind GPTDataset: document order, sample boundaries, sample shuffle.

All three are functions of (document sizes, split documents, seq_length, num_samples, seed) only.
"""

from __future__ import annotations

import numpy as np


def samples_in(num_tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length + 1`` tokens, overlapping by one, that fit in ``num_tokens`` tokens."""
    return max(0, (num_tokens - 1) // seq_length)


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest passes over the split whose token stream holds ``num_samples`` samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("tokens_per_epoch must be positive")
    # need (e * tokens_per_epoch - 1) // seq_length >= num_samples  <=>  e * tpe >= num_samples * seq + 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_epochs: int, num_samples: int) -> bool:
    """Whether the last epoch is shuffled apart from the others: only when it contributes less than
    80% of an epoch's samples (megatron-core's rule), so a prefix of the order covers whole epochs."""
    if num_epochs == 1:
        return False
    before_final = samples_in((num_epochs - 1) * tokens_per_epoch, seq_length)
    from_final = num_samples - before_final
    per_epoch = samples_in(tokens_per_epoch, seq_length)
    if not 0 <= from_final <= per_epoch + 1:
        raise ValueError(f"{num_samples} samples do not end in epoch {num_epochs} of {per_epoch} samples")
    return from_final < int(0.8 * per_epoch)


def build_document_index(doc_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool = False) -> np.ndarray:
    """``doc_ids`` repeated ``num_epochs`` times and shuffled jointly across epochs; with
    ``separate_final`` the first ``num_epochs - 1`` epochs and the last are shuffled apart."""
    if separate_final and num_epochs > 1:
        head = build_document_index(doc_ids, num_epochs - 1, rng)
        return np.concatenate([head, build_document_index(doc_ids, 1, rng)])
    index = np.tile(np.asarray(doc_ids, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(doc_sizes: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` rows of (position in the document index, token offset in that document).

    Sample ``i`` is the ``seq_length + 1`` tokens of the concatenated document stream starting at row
    ``i``; row ``i + 1`` starts at the last token of sample ``i`` (consecutive samples share one token).
    """
    sizes = np.asarray(doc_sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    if num_samples > samples_in(total, seq_length):
        raise ValueError(f"{num_samples} samples of {seq_length + 1} tokens do not fit in {total} tokens")
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - sizes[position])
    return np.stack([position, offset], axis=1).astype(np.int32)


def build_shuffle_index(num_samples: int, first_part: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``range(num_samples)``; ``[0, first_part)`` and the rest are shuffled separately.

    Keeping the samples of a partial last epoch at the end makes a prefix of the order cover the full
    epochs uniformly.
    """
    dtype = np.uint32 if num_samples < 2**32 else np.int64
    head = np.arange(first_part, dtype=dtype)
    tail = np.arange(first_part, num_samples, dtype=dtype)
    rng.shuffle(head)
    rng.shuffle(tail)
    return np.concatenate([head, tail])
