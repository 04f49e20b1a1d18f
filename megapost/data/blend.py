"""Megatron-style data sources: ``--data-path [w1] p1 [w2] p2 ...``, per-split paths, args files.

Builds train/valid/test as megatron-core's ``BlendedMegatronDatasetBuilder`` does: one prefix gives a
GPTDataset; several prefixes give a BlendedDataset over one GPTDataset per prefix (each over that
prefix's share of ``--split``), sized ``ceil(size * w)`` per source (built with a 0.5% surplus), or,
without weights, weighted by each source's one-epoch size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megapost.data.blended_dataset import BlendedDataset, normalize
from megapost.data.errors import DataError
from megapost.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    build_train_valid_test_datasets,
    split_document_ranges,
)
from megapost.data.indexed_dataset import IndexedDataset
from megapost.utils.faults import NO_FAULTS, FaultInjector

MID_LEVEL_SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their (unnormalised) weights; ``weights`` None means "by size"."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def parse_blend(values: Sequence[str] | str | None, flag: str = "--data-path") -> Blend | None:
    """Megatron's list form: prefixes only, or ``weight prefix`` pairs; a quoted list is split."""
    if values is None:
        return None
    tokens = [t for v in ([values] if isinstance(values, str) else values) for t in str(v).split()]
    if not tokens:
        return None
    pairs = len(tokens) % 2 == 0 and all(_is_number(t) for t in tokens[0::2])
    if pairs and len(tokens) >= 2:
        weights = tuple(float(t) for t in tokens[0::2])
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"{flag}: weights must be non-negative with a positive sum, got {list(weights)}")
        prefixes = tuple(tokens[1::2])
        kept = [(w, p) for w, p in zip(weights, prefixes, strict=True) if w > 0]
        return Blend(tuple(p for _, p in kept), tuple(w for w, _ in kept))
    numbers = [t for t in tokens if _is_number(t) and not os.path.exists(t + ".idx")]
    if numbers:
        raise DataError(f"{flag} {' '.join(tokens)}: {numbers[0]!r} looks like a weight; give either "
                        "prefixes only or 'weight prefix' pairs (e.g. 0.3 pathA 0.7 pathB)")
    return Blend(tuple(tokens))


def read_args_file(path: str, flag: str = "--data-args-path") -> list[str]:
    """The whitespace-separated contents of a Megatron data-args file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split()
    except OSError as e:
        raise DataError(f"{flag} {path}: {e.strerror}") from None


def read_per_split_args_file(path: str) -> list[Blend | None]:
    """``--per-split-data-args-path``: JSON ``{"train": [...], "valid": [...], "test": [...]}``."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"--per-split-data-args-path {path}: {e}") from None
    flag = f"--per-split-data-args-path {path}"
    return [parse_blend(spec.get(name), f"{flag} [{name}]") for name in SPLIT_NAMES]


@dataclass(frozen=True)
class DataSources:
    """Either one blend split by ``--split``, or one blend per split (then ``split`` is unused)."""

    blend: Blend | None = None
    per_split: tuple[Blend | None, Blend | None, Blend | None] | None = None

    @property
    def prefixes(self) -> list[str]:
        blends = [self.blend] if self.per_split is None else list(self.per_split)
        seen: dict[str, None] = {}
        for b in blends:
            for p in b.prefixes if b else ():
                seen.setdefault(p, None)
        return list(seen)


def sources_from_args(args: Any) -> DataSources:
    """The data sources named by Megatron's flags on ``args`` (see megapost.config.arguments)."""
    per_split_file = getattr(args, "per_split_data_args_path", None)
    if per_split_file:
        return DataSources(per_split=tuple(read_per_split_args_file(per_split_file)))  # type: ignore[arg-type]
    split_paths = [getattr(args, f"{n}_data_path", None) for n in SPLIT_NAMES]
    if any(split_paths):
        blends = tuple(parse_blend(v, f"--{n}-data-path")
                       for v, n in zip(split_paths, SPLIT_NAMES, strict=True))
        return DataSources(per_split=blends)  # type: ignore[arg-type]
    values = read_args_file(args.data_args_path) if getattr(args, "data_args_path", None) else args.data_path
    return DataSources(blend=parse_blend(values))


def _sizes_per_source(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def _build_split(blend: Blend, name: str, doc_range: Any, size: int | None, seq_length: int, seed: int,
                 cache_dir: str | None, faults: FaultInjector) -> GPTDataset | BlendedDataset | None:
    """One split from one blend; ``doc_range(indexed)`` gives the documents of each source."""
    def gpt(prefix: str, num_samples: int | None) -> GPTDataset | None:
        indexed = IndexedDataset(prefix)
        start, end = doc_range(indexed)
        if end == start:
            return None
        return GPTDataset(indexed, np.arange(start, end, dtype=np.int64), num_samples, seq_length, seed,
                          cache_dir, name, faults)

    if len(blend.prefixes) == 1:
        return gpt(blend.prefixes[0], size)
    if blend.weights is not None:
        weights = normalize(blend.weights)
        if size is None:
            raise DataError(f"{name}: a weighted blend needs a sample count")
        buffers = _sizes_per_source(weights, size, MID_LEVEL_SURPLUS)
        parts = [gpt(p, n) for p, n in zip(blend.prefixes, buffers, strict=True)]
        total = sum(_sizes_per_source(weights, size))
    else:
        parts = [gpt(p, None) for p in blend.prefixes]
        weights = [len(d) if d is not None else 0 for d in parts]
        total = sum(weights) if size is None else min(size, sum(weights))
        if name == "train" and size is not None and size > sum(weights):  # valid/test: truncated
            raise DataError(
                f"{name}: {size} samples asked of a blend weighted by size that holds {sum(weights)} "
                f"(one epoch of {', '.join(blend.prefixes)}); give weights to repeat sources, or train less")
    empty = [p for p, d in zip(blend.prefixes, parts, strict=True) if d is None]
    if empty:
        raise DataError(f"the {name} split of {empty[0]} has no documents; change --split or drop it")
    return BlendedDataset(parts, weights, total, cache_dir, name)


def build_datasets(sources: DataSources, split: str, *, seq_length: int, seed: int,
                   sizes: Sequence[int | None], cache_dir: str | None = None,
                   faults: FaultInjector = NO_FAULTS) -> list[Any]:
    """Train/valid/test datasets (None where a split has no size or no data; ``faults``: a harness's)."""
    out: list[Any] = []
    for i, (name, size) in enumerate(zip(SPLIT_NAMES, sizes, strict=True)):
        if size == 0:
            out.append(None)
            continue
        if sources.per_split is not None:
            blend = sources.per_split[i]
            if blend is None:
                out.append(None)
                continue
            out.append(_build_split(blend, name, lambda ix: (0, len(ix)), size, seq_length, seed, cache_dir,
                                    faults))
            continue
        assert sources.blend is not None
        if len(sources.blend.prefixes) == 1:  # one source: today's split semantics and messages
            return list(build_train_valid_test_datasets(
                sources.blend.prefixes[0], split, seq_length=seq_length, seed=seed,
                train_valid_test_num_samples=sizes, cache_dir=cache_dir, faults=faults))
        ranges = lambda ix, i=i: split_document_ranges(len(ix), split)[i]  # noqa: E731
        out.append(_build_split(sources.blend, name, ranges, size, seq_length, seed, cache_dir, faults))
    if out[0] is None and sizes[0]:
        raise DataError("no training data: the train split is empty (check --split and the data paths)")
    return out
