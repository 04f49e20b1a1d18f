"""A weighted blend of GPT datasets with megatron-core's blending semantics (same sample order)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megapost.data.errors import DataError
from megapost.utils.atomic import atomic_save_npy, atomic_write_text

logger = logging.getLogger(__name__)

BLEND_FORMAT_VERSION = 1


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy interleave: sample ``i`` goes to the dataset furthest behind its share
    ``weights[d] * max(i, 1)`` (first on ties); returns (dataset index, sample index within it)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    ids = range(len(w))
    for i in range(size):
        scale = float(max(i, 1))
        best = max(ids, key=lambda d: (w[d] * scale - counts[d], -d))
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``; indices cached by hash."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int,
                 cache_dir: str | os.PathLike[str] | None = None, name: str = "train") -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"{name} blend: {len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise DataError(f"{name} blend: every weight must be positive, got {list(weights)}")
        self.datasets, self.weights = list(datasets), normalize(weights)
        self.size, self.name = int(size), name
        description = {"version": BLEND_FORMAT_VERSION, "datasets": [d.hash for d in self.datasets],
                       "weights": self.weights, "size": self.size, "name": name}
        self.hash = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir)
        used = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (dataset, n) in enumerate(zip(self.datasets, used, strict=True)):
            if n > len(dataset):
                raise DataError(f"{name} blend: draws {n} samples from dataset {d} "
                                f"({dataset.indexed.prefix}), which has {len(dataset)}")

    def _load_or_build(self, cache_dir: str | os.PathLike[str] | None) -> tuple[np.ndarray, np.ndarray]:
        paths = None
        if cache_dir is not None:
            base = Path(cache_dir) / f"{self.name}_blend_{self.hash[:24]}"
            paths = (Path(f"{base}-dataset_index.npy"), Path(f"{base}-dataset_sample_index.npy"))
            if all(p.is_file() for p in paths):
                try:
                    arrays = tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
                    if all(a.shape == (self.size,) for a in arrays):
                        return arrays[0], arrays[1]
                except (OSError, ValueError):
                    pass
                logger.warning("%s: cached blend indices %s unreadable, rebuilding", self.name, paths[0])
        arrays = build_blending_indices(self.weights, self.size)
        if paths is not None:
            for path, array in zip(paths, arrays, strict=True):
                atomic_save_npy(path, array)
            atomic_write_text(Path(str(paths[0]).replace("-dataset_index.npy", ".json")),
                              json.dumps({"hash": self.hash, "weights": self.weights, "size": self.size,
                                          "datasets": [d.indexed.prefix for d in self.datasets]}) + "\n")
        return arrays

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"{self.name}: sample {idx} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
