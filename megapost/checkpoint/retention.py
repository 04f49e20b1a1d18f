"""--save-retain N / --save-retain-every K: which complete tags a save directory keeps.

Applied by global rank 0 right after a new tag is complete and ``latest`` names it, so a deletion
never leaves the directory without a loadable tag; a tag being written (``*.tmp``) is not a complete
tag and is never touched.
"""

from __future__ import annotations

import os
import shutil

from megapost.checkpoint.io import complete_tags


def tags_to_delete(tags: list[str], latest: str | None, keep: int, every: int, interval: int) -> list[str]:
    """The complete tags (sorted by iteration) that retention removes: all but the newest ``keep``,
    the one ``latest`` names, and (``every`` > 0) tags whose iteration is a multiple of
    ``every x interval``."""
    if keep <= 0:
        return []
    period = every * max(1, interval)
    kept = set(tags[-keep:]) | {latest}
    if every > 0:
        kept |= {t for t in tags if int(t[len("iter_"):]) % period == 0}
    return [t for t in tags if t not in kept]


def apply(directory: str, keep: int, every: int = 0, interval: int = 0) -> list[str]:
    """Delete what :func:`tags_to_delete` names; returns the deleted tags."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            latest: str | None = f.read().strip()
    except OSError:
        latest = None
    doomed = tags_to_delete(complete_tags(directory), latest, keep, every, interval)
    for tag in doomed:
        shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
    return doomed
