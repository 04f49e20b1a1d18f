"""MMIDIDX v1 writer/reader: exact bytes, round trip, dtype choice, validation errors, atomic writes."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megapost.data import DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype
from megapost.utils import atomic_path, atomic_save_npy, atomic_write_text

DOCS = [[5, 1, 65000], [7], [3, 3, 3, 3, 3, 3, 3], [0, 42]]


def _build(prefix: Path, docs: list[list[int]] = DOCS, dtype: type = np.uint16) -> str:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return str(prefix)


def test_idx_and_bin_bytes_follow_the_format(tmp_path: Path) -> None:
    prefix = _build(tmp_path / "d")
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, n_seq, n_doc) == (1, 8, 4, 5)
    off = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from("<4i", raw, off)
    pointers = struct.unpack_from("<4q", raw, off + 16)
    doc_idx = struct.unpack_from("<5q", raw, off + 16 + 32)
    assert lengths == (3, 1, 7, 2)
    assert pointers == (0, 6, 8, 22)  # byte offsets: uint16 tokens
    assert doc_idx == (0, 1, 2, 3, 4)
    assert len(raw) == off + 16 + 32 + 40
    flat = [t for doc in DOCS for t in doc]
    assert Path(prefix + ".bin").read_bytes() == struct.pack(f"<{len(flat)}H", *flat)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip(tmp_path: Path, dtype: type) -> None:
    ds = IndexedDataset(_build(tmp_path / "d", dtype=dtype))
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(DOCS) == ds.num_documents
    assert ds.num_tokens == sum(map(len, DOCS))
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == doc
        assert ds[i].dtype == np.dtype(dtype)
    assert ds.get(2, offset=2, length=3).tolist() == [3, 3, 3]
    assert ds.get(0, offset=1).tolist() == [1, 65000]
    assert ds.sequence_lengths.tolist() == [3, 1, 7, 2]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        ds.get(1, offset=0, length=2)
    with pytest.raises(IndexError):
        ds[4]


def test_best_dtype_and_range_check(tmp_path: Path) -> None:
    assert best_dtype(32000) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32
    ds = IndexedDataset(_build(tmp_path / "wide", [[70000, 1]], dtype=best_dtype(128256)))
    assert Path(ds.prefix + ".idx").read_bytes()[17] == 4  # int32 code
    assert ds[0].tolist() == [70000, 1]
    builder = IndexedDatasetBuilder(tmp_path / "narrow", np.uint16)
    with pytest.raises(DataError, match="out of range"):
        builder.add_document([70000])
    builder.abort()


def test_nothing_under_final_names_until_finalize_and_abort_cleans(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    builder.add_document([1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".d.bin.tmp-{os.getpid()}"]
    builder.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]

    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetBuilder(tmp_path / "e", np.uint16) as b:
        b.add_document([1])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def _idx_with(path: str, offset: int, fmt: str, value: int) -> None:
    raw = bytearray(Path(path + ".idx").read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    Path(path + ".idx").write_bytes(bytes(raw))


CORRUPTIONS = {
    "missing idx": (lambda p: os.remove(p + ".idx"), r"\.idx: index file not found"),
    "missing bin": (lambda p: os.remove(p + ".bin"), r"\.bin: data file not found"),
    "bad magic": (lambda p: _idx_with(p, 0, "<B", ord("X")), r"\.idx: not a Megatron MMIDIDX index"),
    "version": (lambda p: _idx_with(p, 9, "<Q", 2), r"\.idx: unsupported index version 2"),
    "dtype code": (lambda p: _idx_with(p, 17, "<B", 9), r"\.idx: unknown dtype code 9"),
    "truncated idx": (
        lambda p: Path(p + ".idx").write_bytes(Path(p + ".idx").read_bytes()[:-5]),
        r"\.idx: truncated",
    ),
    "truncated header": (
        lambda p: Path(p + ".idx").write_bytes(Path(p + ".idx").read_bytes()[:20]),
        r"\.idx: truncated header",
    ),
    "trailing idx": (lambda p: open(p + ".idx", "ab").write(b"\x00" * 8), r"\.idx: 8 unexpected trailing"),
    "bad length": (lambda p: _idx_with(p, 34, "<i", 4), r"\.idx: corrupt sequence pointers"),
    "truncated bin": (
        lambda p: Path(p + ".bin").write_bytes(Path(p + ".bin").read_bytes()[:-2]),
        r"\.bin: size 24 bytes does not match its index \(26 bytes",
    ),
    "longer bin": (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), r"\.bin: size 28 bytes"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_files_give_a_clear_error(tmp_path: Path, case: str) -> None:
    prefix = _build(tmp_path / "d")
    corrupt, message = CORRUPTIONS[case]
    corrupt(prefix)
    with pytest.raises(DataError, match=message) as err:
        IndexedDataset(prefix)
    text = str(err.value)
    assert str(tmp_path / "d") in text and "\n" not in text
    assert "rebuild the .bin/.idx pair with megapost-preprocess" in text  # the console script


def test_atomic_helpers(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "old")
    with pytest.raises(ValueError), atomic_path(target) as tmp:
        assert tmp.name == f".f.txt.tmp-{os.getpid()}" and tmp.parent == target.parent
        tmp.write_text("partial")
        raise ValueError
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.txt"]

    arr = np.arange(7, dtype=np.int32)
    atomic_save_npy(tmp_path / "a.idx-cache", arr)  # exact name: np.save would append .npy
    assert np.array_equal(np.load(tmp_path / "a.idx-cache"), arr)
