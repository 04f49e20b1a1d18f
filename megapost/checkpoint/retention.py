"""--save-retain N / --save-retain-every K: which tags of the current timeline a save directory keeps.

Applied by global rank 0 right after a new tag is complete and ``latest`` names it
(:meth:`megapost.checkpoint.folder.CheckpointFolder.retain`), so a deletion never leaves the directory
without a loadable tag; a tag being written (``*.tmp``) is not a tag and is never touched, and tags
beyond the iteration training is at are set aside before (never chosen among).
"""

from __future__ import annotations


def tags_to_delete(timeline: list[tuple[int, str]], latest: str | None, keep: int, every: int,
                   interval: int) -> list[str]:
    """The tags of ``timeline`` ((iteration, tag), by iteration) that retention removes: all but the
    newest ``keep``, the one ``latest`` names, and (``every`` > 0) those whose iteration is a multiple
    of ``every x interval``."""
    if keep <= 0:
        return []
    period = every * max(1, interval)
    kept = {t for _, t in timeline[-keep:]} | {latest}
    if every > 0:
        kept |= {t for i, t in timeline if i % period == 0}
    return [t for _, t in timeline if t not in kept]
