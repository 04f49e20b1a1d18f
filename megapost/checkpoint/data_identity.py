"""What data a checkpoint was trained on, stored with each tag (``megapost_meta.json``'s ``data``) and
checked on resume against the data of this launch — not the flag strings of ``args.json``.

The identity of a source is its prefix, the size of its ``.bin`` and a fingerprint (BLAKE2b) of its
``.idx`` (document and sequence boundaries: another tokenization, another corpus or a truncated copy
changes it). The same files under another path are the same data (a note); other data is refused in
one line unless ``--override-data`` (then noted). ``--finetune`` starts on new data by design.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

from megapost.config.errors import ConfigError

_CHUNK = 1 << 20


@functools.lru_cache(maxsize=64)
def _fingerprint(idx_path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(idx_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def of(prefixes: list[str]) -> list[dict[str, Any]]:
    """Each source's prefix (absolute), ``.bin`` bytes and ``.idx`` fingerprint."""
    out = []
    for prefix in prefixes:
        idx = prefix + ".idx"
        st = os.stat(idx)
        out.append({"prefix": os.path.abspath(prefix), "bin_bytes": os.path.getsize(prefix + ".bin"),
                    "idx_blake2b": _fingerprint(idx, st.st_size, st.st_mtime_ns)})
    return out


def _show(sources: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s['prefix']} ({s['bin_bytes']} bytes, idx {s['idx_blake2b'][:8]})" for s in sources)


def check(tag_dir: str, saved: list[dict[str, Any]] | None, ours: list[dict[str, Any]],
          override: bool) -> str | None:
    """Resuming ``tag_dir``: None when it was trained on ``ours`` (or predates stored identities), a
    start-up note when the same files moved or ``override`` accepts other data; else a one-line error."""
    if not saved:
        return None

    def content(sources: list[dict[str, Any]]) -> list[tuple[int, str]]:
        return [(s["bin_bytes"], s["idx_blake2b"]) for s in sources]

    if content(saved) == content(ours):
        if [s["prefix"] for s in saved] == [s["prefix"] for s in ours]:
            return None
        return f"--load {tag_dir}: the same data as it was trained on, now at {_show(ours)}"
    if override:
        return f"--override-data: continuing {tag_dir} on new data ({_show(saved)} -> {_show(ours)})"
    raise ConfigError(f"resuming {tag_dir}, trained on other data ({_show(saved)}; this launch: "
                      f"{_show(ours)}); pass the run's data flags again (or none), or --override-data to "
                      "continue on the new data")
