"""GPT pre-training samples over an IndexedDataset, with Megatron's split/epoch/shuffle semantics."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megapost.data.errors import DataError
from megapost.data.gpt_indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    epochs_needed,
    samples_in,
    separate_final_epoch,
)
from megapost.data.indexed_dataset import IndexedDataset
from megapost.utils.atomic import atomic_save_npy, atomic_write_text
from megapost.utils.checksum import file_sha256
from megapost.utils.faults import NO_FAULTS, FaultInjector

logger = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 2  # 2: epochs shuffled jointly (megatron-core's order)
SPLIT_NAMES = ("train", "valid", "test")
_INDEX_KINDS = ("document_index", "sample_index", "shuffle_index")
_DESCRIPTION = "description"  # written last: its presence marks a complete cache entry


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.int64).tobytes()).hexdigest()


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens drawn from the documents ``doc_ids``.

    The split's documents are concatenated over as many epochs as needed (each epoch shuffled), cut
    into samples that overlap by one token, and the samples shuffled.  With ``cache_dir`` the three
    index arrays are stored as ``.npy`` files keyed by a hash of everything that determines them; a
    file that no longer matches its recorded SHA-256 is rebuilt with a warning, never trained on.
    ``dataset[i]`` is ``{"tokens": int64 array of seq_length + 1}``.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: Sequence[int] | np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        cache_dir: str | os.PathLike[str] | None = None,
        name: str = "train",
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        """``faults``: a test harness's (its ``index_build`` point), none in production."""
        self.faults = faults
        if seq_length < 1:
            raise DataError(f"--seq-length must be positive, got {seq_length}")
        self.indexed = indexed
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name
        if len(self.doc_ids) and (self.doc_ids.min() < 0 or self.doc_ids.max() >= len(indexed)):
            raise DataError(f"{name}: document ids outside 0..{len(indexed) - 1} of {indexed.prefix}")
        sizes = indexed.sequence_lengths[self.doc_ids].astype(np.int64)
        self.tokens_per_epoch = int(sizes.sum())
        if self.tokens_per_epoch < self.seq_length + 1:
            raise DataError(
                f"sequence longer than the data allows: --seq-length {self.seq_length} needs "
                f"{self.seq_length + 1} tokens per sample but the {name} split of {indexed.prefix} has "
                f"{self.tokens_per_epoch} tokens in {len(self.doc_ids)} documents; lower --seq-length, "
                "change --split or add data"
            )
        if num_samples is None:
            num_samples = samples_in(self.tokens_per_epoch, self.seq_length)
        self.num_samples = int(num_samples)
        self.num_epochs = epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)
        self.hash = self._hash(sizes)
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(cache_dir)

    def _hash(self, sizes: np.ndarray) -> str:
        self.built_from = {
            "format_version": INDEX_FORMAT_VERSION,
            "corpus_documents": self.indexed.num_documents,
            "doc_ids_sha256": _sha256(self.doc_ids),
            "doc_sizes_sha256": _sha256(sizes),
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }
        return hashlib.sha256(json.dumps(self.built_from, sort_keys=True).encode()).hexdigest()

    def cache_paths(self, cache_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """The cache files: one ``.npy`` per index array plus a ``.json`` description that holds the
        SHA-256 of each ``.npy`` file and what the arrays were built from."""
        base = f"{self.name}_{self.hash[:24]}"
        paths = {kind: Path(cache_dir) / f"{base}-{kind}.npy" for kind in _INDEX_KINDS}
        paths[_DESCRIPTION] = Path(cache_dir) / f"{base}.json"
        return paths

    def _load_or_build(self, cache_dir: str | os.PathLike[str] | None) -> tuple[np.ndarray, ...]:
        paths = self.cache_paths(cache_dir) if cache_dir is not None else None
        if paths is not None and all(p.is_file() for p in paths.values()):
            problem, arrays = self._load_verified(paths)
            if arrays is not None:
                logger.info("%s: loaded sample indices from %s", self.name, paths["sample_index"])
                return arrays
            logger.warning("%s: cached sample indices %s; rebuilding them", self.name, problem)
        start = time.perf_counter()
        arrays = self._build()
        if paths is not None:
            for kind, array in zip(_INDEX_KINDS, arrays, strict=True):
                atomic_save_npy(paths[kind], array)
            description = {
                "prefix": self.indexed.prefix, "name": self.name, "hash": self.hash, "seed": self.seed,
                "seq_length": self.seq_length, "num_samples": self.num_samples, "num_epochs": self.num_epochs,
                "corpus_tokens": self.indexed.num_tokens, "built_from": self.built_from,
                "sha256": {kind: file_sha256(paths[kind]) for kind in _INDEX_KINDS},
            }
            atomic_write_text(paths[_DESCRIPTION], json.dumps(description, indent=1) + "\n")
        logger.info("%s: built sample indices in %.2fs", self.name, time.perf_counter() - start)
        return arrays

    def _load_verified(self, paths: dict[str, Path]) -> tuple[str, tuple[np.ndarray, ...] | None]:
        """The cached arrays if every file matches the checksum its description records (and the
        description is this dataset's); else what is wrong, naming the file."""
        try:
            description = json.loads(paths[_DESCRIPTION].read_text(encoding="utf-8"))
            recorded = description["sha256"]
            if description.get("built_from") != self.built_from:
                return f"{paths[_DESCRIPTION]} describes other inputs", None
        except (OSError, ValueError, KeyError, TypeError):
            return f"{paths[_DESCRIPTION]} is unreadable or has no checksums", None
        for kind in _INDEX_KINDS:
            if recorded.get(kind) != file_sha256(paths[kind]):
                return f"{paths[kind]} does not match the SHA-256 in {paths[_DESCRIPTION].name}", None
        try:
            arrays = tuple(np.load(paths[k], mmap_mode="r", allow_pickle=False) for k in _INDEX_KINDS)
        except (OSError, ValueError):
            return f"{paths['sample_index']} (or a sibling) is unreadable", None
        if not self._consistent(*arrays):
            return f"{paths['sample_index']} (or a sibling) has the wrong shape", None
        return "", arrays

    def _consistent(self, document_index: np.ndarray, sample_index: np.ndarray, shuffle: np.ndarray) -> bool:
        return (
            document_index.shape == (self.num_epochs * len(self.doc_ids),)
            and sample_index.ndim == 2
            and sample_index.shape[1] == 2
            and shuffle.shape == (sample_index.shape[0] - 1,)
            and shuffle.shape[0] >= self.num_samples
        )

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """megatron-core's order: documents of all epochs shuffled together (the last epoch apart
        when it is short), samples cut from that stream, then shuffled (short last epoch apart)."""
        rng = np.random.RandomState(self.seed)
        separate = separate_final_epoch(self.tokens_per_epoch, self.seq_length, self.num_epochs,
                                        self.num_samples)
        document_index = build_document_index(self.doc_ids, self.num_epochs, rng, separate)
        self.faults.point("index_build")  # the soak (tools/soak.py): a rank killed inside the build
        sizes = self.indexed.sequence_lengths[document_index]
        total = samples_in(self.num_epochs * self.tokens_per_epoch, self.seq_length)
        sample_index = build_sample_index(sizes, self.seq_length, total)
        first = total
        if separate:
            first = samples_in((self.num_epochs - 1) * self.tokens_per_epoch, self.seq_length)
        shuffle_index = build_shuffle_index(total, first, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, sample: int) -> np.ndarray:
        """Tokens of unshuffled sample ``sample`` (position in the concatenated stream)."""
        position, offset = (int(v) for v in self.sample_index[sample])
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        while filled < need:
            doc = int(self.document_index[position])
            take = min(need - filled, int(self.indexed.sequence_lengths[doc]) - offset)
            out[filled : filled + take] = self.indexed.get(doc, offset, take)
            filled += take
            position += 1
            offset = 0
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"{self.name}: sample {idx} out of range for {self.num_samples} samples")
        return {"tokens": self.sample_tokens(int(self.shuffle_index[idx]))}


def parse_split(split: str | Sequence[float]) -> list[float]:
    """``"969,30,1"`` (or ``/`` separated, or numbers) -> three non-negative weights summing to 1."""
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise DataError(f"--split {split!r}: expected up to three comma-separated numbers") from None
    else:
        weights = [float(w) for w in split]
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` document blocks for train/valid/test, proportional to the weights."""
    cumulative = np.cumsum(parse_split(split))
    bounds = [0] + [int(round(c * num_documents)) for c in cumulative]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_train_valid_test_datasets(
    prefix: str | os.PathLike[str],
    split: str | Sequence[float] = "969,30,1",
    *,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: Sequence[int | None],
    cache_dir: str | os.PathLike[str] | None = None,
    faults: FaultInjector = NO_FAULTS,
) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """Train/valid/test GPTDatasets over contiguous document blocks of ``<prefix>.bin/.idx``.

    A split gets ``None`` when it is asked for 0 samples, has weight 0 in ``split``, or (valid/test
    only, with a warning) gets no documents; a train split without documents raises a DataError.
    A sample count of ``None`` means one epoch of that split.
    """
    indexed = IndexedDataset(prefix)
    if len(train_valid_test_num_samples) != 3:
        raise DataError("train_valid_test_num_samples needs three numbers (train, valid, test)")
    if indexed.num_tokens < seq_length + 1:
        raise DataError(
            f"sequence longer than the data allows: --seq-length {seq_length} needs {seq_length + 1} "
            f"tokens per sample but {indexed.prefix} has only {indexed.num_tokens} tokens; "
            "lower --seq-length or add data"
        )
    weights = parse_split(split)
    datasets: list[GPTDataset | None] = []
    for name, weight, (start, end), num_samples in zip(
        SPLIT_NAMES, weights, split_document_ranges(len(indexed), split), train_valid_test_num_samples,
        strict=True,
    ):
        if num_samples == 0 or weight == 0:
            datasets.append(None)
            continue
        if end == start and name != "train":
            logger.warning("the %s split of %s has no documents (--split %s); skipped", name, prefix, split)
            datasets.append(None)
            continue
        if end == start:
            raise DataError(
                f"the {name} split of {indexed.prefix} has no documents ({len(indexed)} documents, "
                f"--split {split}); give it a larger share or add data"
            )
        doc_ids = np.arange(start, end, dtype=np.int64)
        datasets.append(GPTDataset(indexed, doc_ids, num_samples, seq_length, seed, cache_dir, name, faults))
    return datasets[0], datasets[1], datasets[2]
