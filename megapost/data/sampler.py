"""Resumable, data-parallel sample order: a pure function of (dataset order, consumed samples)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class MegatronPretrainingSampler:
    """Yields this rank's micro-batches of sample indices, in order, from ``consumed_samples`` on.

    Global micro-batch ``g`` is samples ``[start + g * B, start + (g + 1) * B)`` with
    ``B = micro_batch_size * data_parallel_size``; rank ``r`` gets the ``r``-th slice of
    ``micro_batch_size``.  A final incomplete global micro-batch is dropped.  With ``infinite`` the
    order wraps around: global sample position ``p`` is dataset index ``p % total_samples``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        infinite: bool = False,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        if consumed_samples < 0 or (not infinite and consumed_samples >= total_samples):
            raise ValueError(f"consumed_samples {consumed_samples} outside the {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.infinite = infinite

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank still gets (the finite case)."""
        return (self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        base, step = self.consumed_samples, self.global_micro_batch
        while self.infinite or base + step <= self.total_samples:
            first = base + self.data_parallel_rank * self.micro_batch_size
            yield [(first + j) % self.total_samples for j in range(self.micro_batch_size)]
            base += step


def collate_tokens(samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack ``seq + 1``-token samples into ``tokens``, ``labels`` (shifted by one), ``loss_mask`` (ones)."""
    import torch  # deferred: the CLI tools import this package and do not need torch

    batch = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
    tokens = batch[:, :-1].contiguous()
    return {
        "tokens": tokens,
        "labels": batch[:, 1:].contiguous(),
        "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
    }


class DataIterator:
    """Endless iterator of this rank's micro-batches; ``consumed_samples`` counts global samples."""

    def __init__(self, dataset: Any, sampler: MegatronPretrainingSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.consumed_samples = sampler.consumed_samples
        self._indices = iter(sampler)

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        indices = next(self._indices)
        batch = collate_tokens([self.dataset[i]["tokens"] for i in indices])
        self.consumed_samples += self.sampler.global_micro_batch
        return batch


def build_data_iterator(
    dataset: Any, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> DataIterator:
    """Batches ``{"tokens", "labels": LongTensor[b, seq], "loss_mask": FloatTensor[b, seq]}`` for one rank.

    Resuming with the ``consumed_samples`` of a checkpoint continues the exact same sample stream.
    """
    sampler = MegatronPretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, infinite=True
    )
    return DataIterator(dataset, sampler)
