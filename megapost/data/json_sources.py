"""Input discovery and reading: JSON-lines shards (.json/.jsonl, optionally .gz) and HF datasets.

Inputs are read in chunks of raw records so that decoding/parsing can happen in worker processes;
``parse_record`` turns one raw record into its text fields, raising DataError with file:line.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megapost.data.errors import DataError

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one source: ``records`` are (line/row number, raw bytes or dict)."""

    source: str
    records: list[tuple[int, bytes | dict[str, Any]]]
    row_label: str = "line"

    def where(self, number: int) -> str:
        """``file:line`` (or ``folder row N``) for error messages."""
        return f"{self.source}:{number}" if self.row_label == "line" else f"{self.source} row {number}"


def is_hf_saved_dataset(path: Path) -> bool:
    """``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def expand_inputs(patterns: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Paths and globs -> existing input paths (each glob sorted), or a DataError naming the culprit."""
    paths: list[Path] = []
    for pattern in patterns:
        pattern = os.fspath(pattern)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not Path(matches[0]).exists():
            raise DataError(f"input not found: {pattern}")
        for match in map(Path, matches):
            if match.is_dir():
                if not is_hf_saved_dataset(match):
                    raise DataError(
                        f"input {match} is a directory but not a datasets save_to_disk folder; "
                        "pass the shard files or a glob"
                    )
            elif not match.name.endswith(JSON_SUFFIXES):
                expected = ", ".join(JSON_SUFFIXES)
                raise DataError(f"input {match}: unsupported file type; expected {expected} or a directory")
            paths.append(match)
    if not paths:
        raise DataError("no input given; pass --input FILE/GLOB or --hf-dataset NAME")
    return paths


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def iter_json_line_chunks(path: Path, chunk_size: int) -> Iterator[Chunk]:
    """Non-blank lines of a JSON-lines file (gzip or plain), as raw bytes, in chunks."""
    records: list[tuple[int, bytes | dict[str, Any]]] = []
    try:
        with _open_binary(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                records.append((lineno, line))
                if len(records) >= chunk_size:
                    yield Chunk(str(path), records)
                    records = []
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e}); the file is damaged or not what its name says") from None
    if records:
        yield Chunk(str(path), records)


def load_hf_dataset(name_or_path: str | os.PathLike[str], split: str) -> Any:
    """A ``datasets.Dataset``: ``load_from_disk`` for a saved folder, else ``load_dataset`` (local)."""
    import datasets  # deferred: slow to import and only needed here

    path = Path(name_or_path)
    try:
        if is_hf_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{path}: no split {split!r} (has {', '.join(loaded)}); pass --hf-split")
                loaded = loaded[split]
            return loaded
        return datasets.load_dataset(os.fspath(name_or_path), split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; report one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot load dataset {name_or_path} (split {split}): {first}") from None


def iter_hf_chunks(dataset: Any, label: str, keys: Sequence[str], chunk_size: int) -> Iterator[Chunk]:
    """Rows of a ``datasets.Dataset`` restricted to ``keys``, in chunks."""
    missing = [k for k in keys if k not in dataset.column_names]
    if missing:
        has = ", ".join(dataset.column_names)
        raise DataError(f"{label}: no column {missing[0]!r} (has {has}); fix --json-keys")
    row = 0
    for batch in dataset.select_columns(list(keys)).iter(batch_size=chunk_size):
        n = len(batch[keys[0]])
        records: list[tuple[int, bytes | dict[str, Any]]] = [
            (row + i, {k: batch[k][i] for k in keys}) for i in range(n)
        ]
        row += n
        yield Chunk(label, records, row_label="row")


def iter_input_chunks(
    paths: Sequence[Path], keys: Sequence[str], chunk_size: int, hf_split: str = "train"
) -> Iterator[Chunk]:
    """All records of all inputs in order."""
    for path in paths:
        if path.is_dir():
            yield from iter_hf_chunks(load_hf_dataset(path, hf_split), str(path), keys, chunk_size)
        else:
            yield from iter_json_line_chunks(path, chunk_size)


def record_size(record: bytes | dict[str, Any]) -> int:
    """Input bytes a record stands for (for MB/s)."""
    if isinstance(record, bytes):
        return len(record)
    return sum(len(v) for v in record.values() if isinstance(v, str))


def parse_record(record: bytes | dict[str, Any], keys: Sequence[str], where: str) -> dict[str, str]:
    """The text of each key; DataError naming ``where`` for bad UTF-8, bad JSON or a missing key."""
    if isinstance(record, bytes):
        try:
            line = record.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start})") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    texts = {}
    for key in keys:
        value = record.get(key)
        if not isinstance(value, str):
            if key not in record:
                problem = "missing"
            elif value is None:
                problem = "null"
            else:
                problem = f"a {type(value).__name__}, not a string"
            raise DataError(f"{where}: field {key!r} is {problem}")
        texts[key] = value
    return texts
