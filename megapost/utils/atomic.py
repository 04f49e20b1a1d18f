"""Atomic file creation: write to a hidden temp file beside the target, then rename onto it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def temp_path_for(final_path: str | os.PathLike[str]) -> Path:
    """The temp name used for ``final_path``: ``.<name>.tmp-<pid>`` in the same directory."""
    final = Path(final_path)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike[str], fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path; on success it is renamed onto ``final_path``, on exception it is deleted.

    Readers therefore see either the old file or the complete new one, never a partial write.
    The parent directory is created if needed.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"atomic_path: nothing was written to {tmp} for {final}")
        if fsync:
            _fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)


def atomic_save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """``np.save`` to exactly ``path`` (no ``.npy`` appended) atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.asarray(array), allow_pickle=False)
