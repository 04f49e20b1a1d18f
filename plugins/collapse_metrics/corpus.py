"""The dataset's own frequency loss: the train split's label entropy, streamed once, cached beside the
sample-index cache (``<cache>/<name>-freq-<key>.json``, keyed by the data files' size and mtime, the
split and the sequence length) so later runs read it instantly."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from megapost.plugin_api import DatasetReader, atomic_write_text

from .frequency import FrequencyLossResult, streaming_frequency_loss

CHUNK_TOKENS = 1 << 22


def _chunks(tokens: np.ndarray) -> Iterator[np.ndarray]:
    for lo in range(0, len(tokens), CHUNK_TOKENS):
        yield np.asarray(tokens[lo:lo + CHUNK_TOKENS], dtype=np.int64)


def cache_path(prefix: str, split: str, seq_length: int, cache_dir: str | os.PathLike[str]) -> Path:
    stats = [os.stat(p) for p in (f"{prefix}.bin", f"{prefix}.idx")]
    files = [(s.st_size, s.st_mtime_ns) for s in stats]
    key = json.dumps([os.path.abspath(prefix), split, seq_length, files])
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{Path(prefix).name}-freq-{digest}.json"


def train_split_frequency_loss(data: DatasetReader, seq_length: int, vocab_size: int) -> FrequencyLossResult:
    """Aggregated and per-sequence (``seq_length`` labels) frequency loss of ``data``'s train split."""
    prefix, split, cache_dir = data.prefix, data.split, data.cache_dir
    path = cache_path(prefix, split, seq_length, cache_dir) if cache_dir else None
    if path is not None and path.is_file():
        try:
            return FrequencyLossResult(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):
            pass  # unreadable: recompute and overwrite
    tokens = data.train_tokens()
    result = streaming_frequency_loss(_chunks(tokens), vocab_size, seq_len=seq_length)
    if path is not None:
        atomic_write_text(path, json.dumps(asdict(result)))
    return result
