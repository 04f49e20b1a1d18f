"""The checkpoint folder as one object (megapost.checkpoint.folder): tag names past 10M iterations,
``latest`` falling back to the newest complete tag, a crash-safe re-publish, retention on the current
timeline — with literal expected tag lists after a resume from an older tag, a ``--finetune`` into the
same folder and a rollback — and Megatron's ``--ckpt-step``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launch_utils import pretrain, tiny_model_flags

from megapost.checkpoint.folder import CheckpointFolder, iteration_of, tag_of
from megapost.config.arguments import parse_args
from megapost.config.errors import ConfigError


def _tag(tmp: Path, name: str, complete: bool = True) -> None:
    """A tag directory with one 4-byte shard and a manifest (``complete``: listing it at its size)."""
    d = tmp / name / "layout_free"
    d.mkdir(parents=True)
    (d / "shard.safetensors").write_bytes(b"abcd")
    (d / "manifest.json").write_text(json.dumps({"format": 1, "files": {
        "layout_free/shard.safetensors": 4 if complete else 5}}))


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("iter_"))


def _aside(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "set-aside").iterdir()) if (folder / "set-aside").is_dir() else []


def test_tags_past_ten_million_iterations_sort_by_iteration(tmp_path) -> None:
    assert tag_of(100) == "iter_0000100" and tag_of(12_345_678) == "iter_12345678"
    assert iteration_of("iter_12345678") == 12_345_678 and iteration_of("iter_0000100.tmp") is None
    for name in ("iter_9999999", "iter_10000000", "iter_0000500", "iter_10000001.tmp"):
        _tag(tmp_path, name)
    folder = CheckpointFolder(str(tmp_path))
    assert folder.tags() == ["iter_0000500", "iter_9999999", "iter_10000000"]
    (tmp_path / "latest").write_text("iter_10000000")
    assert folder.resolve().tag == "iter_10000000"
    assert folder.retain(10_000_000, keep=1) == ["iter_0000500", "iter_9999999"]
    assert folder.tags() == ["iter_10000000"]


def test_latest_naming_a_missing_tag_falls_back_with_a_note(tmp_path) -> None:
    _tag(tmp_path, "iter_0000002")
    _tag(tmp_path, "iter_0000004")
    _tag(tmp_path, "iter_0000006", complete=False)  # a rank's file truncated after publishing
    folder = CheckpointFolder(str(tmp_path))
    (tmp_path / "latest").write_text("iter_0000006")
    r = folder.resolve()  # damaged after publishing: loaded, so that the loader names the broken file
    assert r.tag == "iter_0000006" and r.note is None and folder.last_complete() is None
    (tmp_path / "latest").write_text("iter_0000008")
    r = folder.resolve()
    assert r.tag == "iter_0000004" and "names iter_0000008, which is missing or incomplete" in r.note
    (tmp_path / "latest").unlink()
    assert folder.resolve().tag == "iter_0000004" and "missing, empty or unreadable" in folder.resolve().note
    (tmp_path / "latest").write_text("iter_0000002")
    assert folder.resolve().tag == "iter_0000002"
    assert folder.resolve().note is None
    assert folder.resolve(step=4).tag == "iter_0000004"
    with pytest.raises(ConfigError, match="--ckpt-step 6: .* has no complete iter_0000006"):
        folder.resolve(step=6)
    with pytest.raises(ConfigError, match="no complete tag"):
        CheckpointFolder(str(tmp_path / "empty")).resolve()


def test_republish_is_crash_safe(tmp_path, monkeypatch) -> None:
    # saving iteration 4 again: a crash between moving the old copy away and renaming the new one in
    _tag(tmp_path, "iter_0000004")
    (tmp_path / "latest").write_text("iter_0000004")
    _tag(tmp_path, "iter_0000004.tmp")
    (tmp_path / "iter_0000004.tmp" / "new").write_text("new copy")
    folder = CheckpointFolder(str(tmp_path))
    real, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        folder.publish("iter_0000004")
    monkeypatch.setattr(os, "replace", real)
    r = folder.resolve()  # 'latest' names iter_0000004, absent: its previous copy loads
    assert r.tag == "iter_0000004.old" and (tmp_path / r.tag / "layout_free").is_dir()
    folder.clean()  # the next save: the old copy is put back, the torn temp tag removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "latest"]
    assert folder.resolve().tag == "iter_0000004" and not (tmp_path / "iter_0000004" / "new").exists()
    _tag(tmp_path, "iter_0000004.tmp")  # and a complete re-publish replaces it
    (tmp_path / "iter_0000004.tmp" / "new").write_text("new copy")
    folder.publish("iter_0000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "latest"]
    assert (tmp_path / "iter_0000004" / "new").exists()


def test_retention_chooses_on_the_timeline_only(tmp_path) -> None:
    for i in (2, 4, 6, 8, 10):
        _tag(tmp_path, tag_of(i))
    (tmp_path / "latest").write_text("iter_0000004")
    folder = CheckpointFolder(str(tmp_path))
    # at iteration 6 (after a resume from 4): 8 and 10 are not on the timeline; 4 is 'latest'
    assert folder.retain(6, keep=1) == ["iter_0000002"]
    assert _names(tmp_path) == ["iter_0000004", "iter_0000006", "iter_0000008", "iter_0000010"]
    assert folder.set_aside(6) == ["iter_0000008", "iter_0000010"]
    assert _names(tmp_path) == ["iter_0000004", "iter_0000006"]
    assert _aside(tmp_path) == ["iter_0000008", "iter_0000010"]
    _tag(tmp_path, "iter_0000008")
    (tmp_path / "latest").write_text("iter_0000008")
    assert folder.set_aside(4) == ["iter_0000006", "iter_0000008"]  # 'latest' named a moved tag
    assert (tmp_path / "latest").read_text() == "iter_0000004"
    assert _aside(tmp_path) == ["iter_0000006", "iter_0000008", "iter_0000008.1", "iter_0000010"]
    for i in range(5, 21):
        _tag(tmp_path, tag_of(i))
    (tmp_path / "latest").write_text("iter_0000020")
    assert folder.retain(20, keep=2, every=3, interval=2) == [
        "iter_0000004", "iter_0000005", "iter_0000007", "iter_0000008", "iter_0000009", "iter_0000010",
        "iter_0000011", "iter_0000013", "iter_0000014", "iter_0000015", "iter_0000016", "iter_0000017"]
    assert _names(tmp_path) == ["iter_0000006", "iter_0000012", "iter_0000018", "iter_0000019",
                                "iter_0000020"]
    assert folder.retain(20, keep=0) == []
    (tmp_path / "iter_0000021.tmp").mkdir()  # a tag being written is never touched
    folder.retain(21, keep=1)
    assert (tmp_path / "iter_0000021.tmp").is_dir() and _names(tmp_path) == ["iter_0000020",
                                                                             "iter_0000021.tmp"]
    with pytest.raises(ConfigError, match="--save-retain-every needs --save-retain"):
        parse_args(["--save-retain-every", "2"])
    for flag in (["--finetune"], ["--ckpt-step", "4"]):
        with pytest.raises(ConfigError, match=f"{flag[0]} says what --load restores"):
            parse_args(flag)


def _run(data, ckpt: Path, **flags) -> str:
    return pretrain(tiny_model_flags(data, **{"--save": ckpt, "--save-interval": 2, "--lr-decay-iters": 10,
                                              **flags})).stdout


@pytest.mark.integration
@pytest.mark.slow
def test_retention_after_resume_from_older_tag_and_finetune(tiny_data, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(tiny_data, ckpt, **{"--train-iters": 8})
    assert _names(ckpt) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000008"]
    # resume from the older tag 4 (--ckpt-step), two iterations, keep 2: 6 and 8 are of another timeline
    out = _run(tiny_data, ckpt, **{"--train-iters": 6, "--load": ckpt, "--ckpt-step": 4, "--save-retain": 2})
    assert "--ckpt-step 4: loading iter_0000004" in out and "resumed from" in out
    assert "2 tags beyond iteration 4 (not on this run's timeline) moved to" in out
    assert _names(ckpt) == ["iter_0000004", "iter_0000006"]
    assert _aside(ckpt) == ["iter_0000006", "iter_0000008"]
    assert (ckpt / "latest").read_text() == "iter_0000006"
    # --finetune into the same folder, keep 1: the run restarts at iteration 0
    out = _run(tiny_data, ckpt, **{"--train-iters": 4, "--load": ckpt, "--finetune": True,
                                   "--save-retain": 1})
    assert "1 tags beyond iteration 0" in out  # iter_0000004; iter_0000006 (loaded) stays until a save
    assert _names(ckpt) == ["iter_0000004"] and (ckpt / "latest").read_text() == "iter_0000004"
    assert _aside(ckpt) == ["iter_0000004", "iter_0000006", "iter_0000006.1", "iter_0000008"]
