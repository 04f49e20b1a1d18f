"""Atomic file creation: write to a hidden temp file beside the target, then rename onto it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def temp_path_for(final_path: str | os.PathLike[str]) -> Path:
    """The temp name used for ``final_path``: ``.<name>.tmp-<pid>`` in the same directory."""
    final = Path(final_path)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


logger = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _unlocked(path: Path) -> bool:
    """No process holds an flock on ``path`` (writers that stream for long hold one, see lock_temp)."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        return False
    except OSError:
        return False
    return True


def lock_temp(f: object) -> None:
    """Hold an exclusive flock on an open temp file while writing it: ``remove_stale_temps`` on another
    host (where our pid means nothing) then still leaves it alone. Released when the file closes."""
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]


def remove_stale_temps(final_path: str | os.PathLike[str]) -> list[Path]:
    """Delete ``.<name>.tmp-<pid>`` files beside ``final_path`` left by writers that died (killed runs).

    A temp is stale when its pid is not a live process on this host, it is not ours, and no process
    holds a lock on it; anything else is kept. Returns what was removed (each logged once).
    """
    final = Path(final_path)
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.tmp-(\d+)$")
    removed = []
    try:
        candidates = list(final.parent.iterdir())
    except OSError:
        return removed
    for path in candidates:
        m = pattern.match(path.name)
        if not m or not path.is_file():
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid) or not _unlocked(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            path.unlink()
            removed.append(path)
            logger.warning("removed stale temporary %s (%.1f MB; its writer, pid %d, is gone)",
                           path, size / 1e6, pid)
    return removed


def current_umask() -> int:
    """The process umask, read from /proc (no os.umask round trip, which would race other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_default_mode(path: str | os.PathLike[str]) -> None:
    """``chmod`` ``path`` to what ``open`` would create (0666 less the umask, 0644 by default): writers
    that go through a private temp (safetensors' ``save_file``, ``mkstemp``) leave files 0600."""
    os.chmod(path, 0o666 & ~current_umask())


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
    The parent directory is created if needed; the file gets the umask's default mode (0644), whatever
    mode the writer of the temp gave it.
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
        give_default_mode(tmp)
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
