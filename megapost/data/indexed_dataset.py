"""Megatron-compatible memory-mapped indexed dataset (``.bin`` tokens + ``.idx`` index, MMIDIDX v1).

``.idx`` layout (little endian)::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    <Q       version (1)
    <B       dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    <Q       sequence count S
    <Q       document count D (number of document boundaries: documents + 1)
    int32[S] sequence lengths (tokens)
    int64[S] sequence byte offsets into .bin
    int64[D] document indices (sequence index where each document starts, then S)

``.bin`` is the raw token array of all sequences back to back.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megapost.data.errors import DataError
from megapost.utils.atomic import lock_temp, remove_stale_temps, temp_path_for

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_REBUILD = "rebuild the .bin/.idx pair with megapost-preprocess"


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for ``dtype``."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        supported = ", ".join(sorted(map(str, _CODE_OF)))
        raise DataError(f"dtype {dt} cannot be stored in an indexed dataset; use one of {supported}")
    return _CODE_OF[dt]


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype for ``vocab_size``: uint16 below 65500, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def index_file_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


class IndexedDatasetBuilder:
    """Writes ``<prefix>.bin``/``<prefix>.idx``; nothing appears under those names until ``finalize``.

    Tokens stream to a hidden temp file; ``finalize`` writes the index beside it and renames both
    (``.bin`` first, ``.idx`` last).  Used as a context manager it finalizes on success and removes
    the temp files on an exception.  Temps of earlier writers that died (``remove_stale_temps``) are
    removed first.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._bin_path = data_file_path(self.prefix)
        self._idx_path = index_file_path(self.prefix)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        for final in (self._bin_path, self._idx_path):  # left by killed runs, which no one else removes
            remove_stale_temps(final)
        self._bin_tmp = temp_path_for(self._bin_path)
        self._idx_tmp = temp_path_for(self._idx_path)
        self._bin = open(self._bin_tmp, "wb")  # closed by finalize/abort
        lock_temp(self._bin)
        self._lengths: list[int] = []
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.num_tokens = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self._lengths)

    def add_document(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (stored as a single sequence)."""
        if self.closed:
            raise RuntimeError("IndexedDatasetBuilder is already finalized or aborted")
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise DataError(f"a document must be a 1-D list of token ids, got shape {arr.shape}")
        if self._info is not None and arr.size and (arr.min() < self._info.min or arr.max() > self._info.max):
            raise DataError(
                f"token id out of range for dtype {self.dtype} ({arr.min()}..{arr.max()}) while writing "
                f"{self._bin_path}; build with a wider dtype (see best_dtype)"
            )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self.closed:
            raise RuntimeError("IndexedDatasetBuilder is already finalized or aborted")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.asarray(self._lengths, dtype=np.int32)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
            with open(self._idx_tmp, "wb") as f:
                code = dtype_code(self.dtype)
                f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, code, len(lengths), len(document_indices)))
                f.write(lengths.tobytes(order="C"))
                f.write(pointers.tobytes(order="C"))
                f.write(document_indices.tobytes(order="C"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._bin_tmp, self._bin_path)
            os.replace(self._idx_tmp, self._idx_path)
            self.closed = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop everything written so far (no file is left under the final names)."""
        self.closed = True
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of ``<prefix>.bin``/``<prefix>.idx`` through ``np.memmap``; validated on open."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_path = index_file_path(self.prefix)
        self.bin_path = data_file_path(self.prefix)
        self._read_index()
        self._read_data()

    @staticmethod
    def _fail(path: Path, what: str, todo: str = _REBUILD) -> DataError:
        return DataError(f"{path}: {what}; {todo}")

    def _read_index(self) -> None:
        path = self.idx_path
        if not path.is_file():
            raise self._fail(path, "index file not found", "check the data path prefix or " + _REBUILD)
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise self._fail(path, "not a Megatron MMIDIDX index (bad magic bytes)")
        if len(head) < _HEADER.size:
            raise self._fail(path, f"truncated header ({size} bytes)")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != INDEX_VERSION:
            raise self._fail(path, f"unsupported index version {version} (only {INDEX_VERSION} is supported)")
        if code not in DTYPE_CODES:
            raise self._fail(path, f"unknown dtype code {code}")
        self.dtype: np.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if size < expected:
            raise self._fail(path, f"truncated: {size} bytes but the header needs {expected}")
        if size > expected:
            raise self._fail(
                path, f"{size - expected} unexpected trailing bytes (multimodal indices are not supported)"
            )
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths: np.ndarray = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=off)
        off += n_seq * 4
        self.sequence_pointers: np.ndarray = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=off)
        off += n_seq * 8
        self.document_indices: np.ndarray = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=off)
        self._check_index()

    def _check_index(self) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            raise self._fail(self.idx_path, "corrupt document indices")
        if np.any(lengths < 0):
            raise self._fail(self.idx_path, "corrupt sequence lengths (negative)")
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(expected, pointers):
            raise self._fail(self.idx_path, "corrupt sequence pointers (do not match the sequence lengths)")

    def _read_data(self) -> None:
        path = self.bin_path
        if not path.is_file():
            raise self._fail(path, "data file not found")
        size = path.stat().st_size
        expected = int(self.sequence_lengths.astype(np.int64).sum()) * self.dtype.itemsize
        if size != expected:
            raise self._fail(
                path, f"size {size} bytes does not match its index ({expected} bytes expected: truncated or "
                "from another run)"
            )
        self._bin = np.memmap(path, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)

    @property
    def tokens(self) -> np.ndarray:
        """All tokens of all sequences back to back (memory-mapped, read-only)."""
        return self._bin

    @property
    def num_tokens(self) -> int:
        return int(self._bin.shape[0])

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.prefix}")
        idx %= n
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of {seq_len}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start : start + length])

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(int(idx))

    @staticmethod
    def exists(prefix: str | os.PathLike[str]) -> bool:
        """Both files are present (not validated)."""
        return data_file_path(prefix).is_file() and index_file_path(prefix).is_file()
