"""The checkpoint folder (``--save`` / ``--load``) as one object: its tags, the one reader of ``latest``,
publishing a tag, retention on the current timeline, and setting aside tags beyond the resume point.

A tag is ``iter_`` and the iteration, zero-padded to 7 digits as Megatron-LM writes it (wider past
9,999,999); tags sort by their iteration, never by name. A tag is written under ``<tag>.tmp`` and
takes its final name only once complete (:meth:`CheckpointFolder.publish`), so a tag under its final
name is complete unless something removed its files later (:meth:`CheckpointFolder.is_complete`).

The *timeline* is the tags at or before the iteration training is at: after a resume from an older
tag, a ``--finetune`` into the same folder or a guard rollback, tags beyond it belong to a run that no
longer continues. They are moved (never deleted) into ``<folder>/set-aside/`` — at start-up with a
note, or by the first save after a rollback — so retention chooses only among tags of this run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass

from megapost.checkpoint import retention
from megapost.checkpoint.format import check_complete
from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_write_text

LATEST = "latest"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"  # the previous copy of a tag being re-published, until the new one is in place
ASIDE = "set-aside"
_TAG = re.compile(r"iter_(\d{7,})")


def tag_of(iteration: int) -> str:
    """``iter_0000100``: Megatron-LM's tag name (7 digits, more past 9,999,999)."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration a tag name stands for, None for anything else (temp and old copies included)."""
    m = _TAG.fullmatch(name)
    return int(m.group(1)) if m else None


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Resolved:
    """The tag to load and, when it is not what ``latest`` names, a one-line start-up note why."""

    tag: str
    note: str | None = None


class CheckpointFolder:
    """One checkpoint directory. Reading is safe on every rank; changing it (publish, retain,
    set aside, clean up) is global rank 0's."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---- reading --------------------------------------------------------------------------
    def tags(self) -> list[str]:
        """Every published tag, by iteration."""
        if not os.path.isdir(self.path):
            return []
        found = [(iteration_of(n), n) for n in os.listdir(self.path)]
        return [n for i, n in sorted((i, n) for i, n in found if i is not None) if os.path.isdir(self._p(n))]

    def is_complete(self, name: str) -> bool:
        """Its directory holds every file its manifest lists at the listed size (a tag without
        megapost's sharded part: DeepSpeed's ``.pt`` files)."""
        tag_dir = self._p(name)
        if not os.path.isdir(tag_dir):
            return False
        try:
            if check_complete(tag_dir):
                return True
        except (ConfigError, OSError, ValueError, KeyError):
            return False
        return any(n.endswith(".pt") for n in os.listdir(tag_dir))

    def has_latest(self) -> bool:
        """A ``latest`` file is there (whatever it says)."""
        return os.path.isfile(self._p(LATEST))

    def latest_name(self) -> str | None:
        """What ``latest`` says (stripped), None when it is missing, empty or unreadable."""
        try:
            with open(self._p(LATEST), encoding="utf-8") as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return name if name and "\0" not in name and "\n" not in name else None

    def resolve(self, flag: str = "--load", step: int | None = None) -> Resolved:
        """The tag to load: ``--ckpt-step`` ``step``'s, else the one ``latest`` names, else (missing,
        unreadable, or naming a tag that does not exist) the newest complete tag with a note; a one-line
        error when none."""
        tags = self.tags()
        have = f"tags there: {', '.join(tags[-3:])}" if tags else "no tag there"
        if step is not None:
            tag = tag_of(step)
            if not self.is_complete(tag):
                raise ConfigError(f"--ckpt-step {step}: {self.path} has no complete {tag} ({have}); pick "
                                  "one of its tags' iterations")
            return Resolved(tag, f"--ckpt-step {step}: loading {tag} from {self.path} (not 'latest')")
        named = self.latest_name()
        if named is not None and os.path.isdir(self._p(named)):
            # complete, or damaged after publishing (a lost or truncated rank file): loading it names
            # what is wrong in one line, rather than resuming silently from an older tag
            return Resolved(named)
        if named is not None and not os.path.isdir(self._p(named)) and self.is_complete(named + OLD_SUFFIX):
            return Resolved(named + OLD_SUFFIX, f"{flag} {self.path}: {named} was being re-published; "
                                                "loading its previous copy")
        fallback = next((t for t in reversed(tags) if self.is_complete(t)), None)
        if fallback is None:
            if not os.path.exists(self._p(LATEST)):
                why = "no 'latest' file"
            elif named is None:
                why = "'latest' is empty or unreadable"
            else:
                why = f"'latest' names {named}, which does not exist"
            raise ConfigError(f"{flag} {self.path}: {why} and no complete tag ({have}); is this a megapost/"
                              "DeepSpeed checkpoint?")
        why = f"names {named}, which is missing or incomplete" if named else "is missing, empty or unreadable"
        return Resolved(fallback, f"{flag} {self.path}: 'latest' {why}; loading the newest complete tag, "
                                  f"{fallback}")

    def last_complete(self) -> str | None:
        """``folder/tag`` a resume would load now, None when there is none."""
        try:
            tag = self.resolve().tag
        except ConfigError:
            return None
        return self._p(tag) if self.is_complete(tag) else None

    def tag_dir(self, flag: str = "--load", step: int | None = None) -> str:
        """The directory of the tag :meth:`resolve` picks (``step``: that iteration's)."""
        return self._p(self.resolve(flag, step).tag)

    # ---- changing (global rank 0) ---------------------------------------------------------
    def publish(self, tag: str) -> None:
        """``<tag>.tmp`` (complete) takes the final name and ``latest`` names it. Saving an iteration
        again: the old copy becomes ``<tag>.old`` only after the new one is complete, and
        :meth:`resolve` loads it while ``<tag>`` is absent, so ``latest`` never names nothing."""
        final, old = self._p(tag), self._p(tag + OLD_SUFFIX)
        if os.path.isdir(final):
            if os.path.isdir(old):
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(self._p(tag + TMP_SUFFIX), final)
        _fsync_dir(self.path)
        atomic_write_text(self._p(LATEST), tag)
        _fsync_dir(self.path)
        shutil.rmtree(old, ignore_errors=True)

    def clean(self) -> None:
        """Before a save: temp tags of saves that never completed go; an ``.old`` copy left by a
        re-publish that was cut short is deleted when the new copy is there, else put back."""
        if not os.path.isdir(self.path):
            return
        for name in os.listdir(self.path):
            path = self._p(name)
            if name.endswith(TMP_SUFFIX) and iteration_of(name[: -len(TMP_SUFFIX)].split(".")[0]) is not None:
                if os.path.islink(path) or not os.path.isdir(path):
                    os.unlink(path)
                else:
                    shutil.rmtree(path, ignore_errors=True)
            elif name.endswith(OLD_SUFFIX) and iteration_of(name[: -len(OLD_SUFFIX)]) is not None:
                tag = name[: -len(OLD_SUFFIX)]
                if os.path.isdir(self._p(tag)):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.replace(path, self._p(tag))

    def beyond(self, iteration: int, spare: str | None = None) -> list[str]:
        """The tags past ``iteration`` but ``spare``: not on the timeline of a run at ``iteration``."""
        return [t for t in self.tags() if (iteration_of(t) or 0) > iteration and t != spare]

    def set_aside(self, iteration: int, spare: str | None = None) -> list[str]:
        """Move :meth:`beyond`'s tags into ``set-aside/`` (a later copy of the same tag gets a ``.N``
        suffix); ``latest`` then names the newest tag left, if it named a moved one."""
        moved = self.beyond(iteration, spare)
        if not moved:
            return []
        aside = self._p(ASIDE)
        os.makedirs(aside, exist_ok=True)
        for tag in moved:
            dest, n = os.path.join(aside, tag), 1
            while os.path.exists(dest):
                dest, n = os.path.join(aside, f"{tag}.{n}"), n + 1
            os.replace(self._p(tag), dest)
        left = self.tags()
        if self.latest_name() in moved and left:
            atomic_write_text(self._p(LATEST), left[-1])
        _fsync_dir(self.path)
        return moved

    def retain(self, iteration: int, keep: int, every: int = 0, interval: int = 0) -> list[str]:
        """``--save-retain keep`` / ``--save-retain-every every``: delete the tags of the timeline (at or
        before ``iteration``) but the newest ``keep``, the one ``latest`` names and (``every``) those
        whose iteration is a multiple of ``every x interval``; returns the deleted tags."""
        timeline = [(i, t) for i, t in ((iteration_of(t), t) for t in self.tags())
                    if i is not None and i <= iteration]
        doomed = retention.tags_to_delete(timeline, self.latest_name(), keep, every, interval)
        for tag in doomed:
            shutil.rmtree(self._p(tag), ignore_errors=True)
        return doomed


def last_complete(directory: str | None) -> str | None:
    """``directory/tag`` a resume from ``directory`` would load now, else None."""
    return CheckpointFolder(directory).last_complete() if directory else None
