"""Checkpoints that cannot run code, are never poisoned or torn, and fail in one line.

Everything goes through the real trainer (``megapost.pretrain``: DeepSpeed engine, files on disk); one
small checkpoint (ZeRO-1, 2 iterations) is saved once per format (megapost's sharded safetensors, and
``--ckpt-format deepspeed`` with DeepSpeed's pickled files too) and copied per test.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_utils import REPO, child_env, pretrain, read_scalars, tiny_model_flags

from megapost.checkpoint.format import META_FILE, write_manifest
from megapost.checkpoint.reader import ShardIndex
from megapost.checkpoint.safety import ALLOWED_GLOBALS, SafeCheckpointEngine, load_file, write_error
from megapost.checkpoint.stream_write import write_safetensors
from megapost.config.errors import ConfigError
from megapost.utils.atomic import temp_path_for

MODEL_STATES = "mp_rank_00_model_states.pt"


class Payload:
    """Unpickling this creates the directory ``path`` (stands in for any code an attacker would run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _flags(data, **overrides) -> list[str]:
    return tiny_model_flags(data, **{"--zero-stage": 1, **overrides})


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckptsafe") / "ckpt"
    pretrain(_flags(tiny_data, **{"--train-iters": 2, "--save": ckpt}))
    return ckpt


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def saved_ds(tiny_data, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckptsafe_ds") / "ckpt"
    pretrain(_flags(tiny_data, **{"--train-iters": 2, "--save": ckpt, "--ckpt-format": "deepspeed"}))
    return ckpt


@pytest.fixture
def ckpt_ds(saved_ds, tmp_path) -> Path:
    return Path(shutil.copytree(saved_ds, tmp_path / "ckpt_ds"))


def _error(argv: list[str]) -> str:
    from megapost.pretrain import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    msg = str(info.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def _allowed() -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in ALLOWED_GLOBALS}


# ---------------------------------------------------------------------------- 1. no code on --load
@pytest.mark.integration
def test_crafted_checkpoint_never_runs_its_payload(tiny_data, ckpt_ds, tmp_path) -> None:
    """DeepSpeed's pickled files (--ckpt-format deepspeed) go through the allowlist (megapost's own
    format is safetensors and JSON only: nothing there can run code)."""
    ckpt = ckpt_ds
    marker = tmp_path / "payload-ran"
    path = ckpt / "iter_0000002" / MODEL_STATES
    state = load_file(str(path))  # megapost's own files load under the allowlist
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) <= _allowed()
    state["args"]["note"] = Payload(str(marker))
    torch.save(state, path)
    write_manifest(str(path.parent))  # an attacker rewrites the size list too: the safe loader must refuse
    proc = pretrain(_flags(tiny_data, **{"--train-iters": 4, "--load": ckpt}), check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not marker.exists(), text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and "--trust-checkpoint" in errors[0], text[-3000:]
    assert "posix.mkdir" in errors[0] and "Traceback" not in text
    # the engine DeepSpeed reads through refuses it too, and only --trust-checkpoint unpickles it
    with pytest.raises(ConfigError, match="--trust-checkpoint"):
        SafeCheckpointEngine().load(str(path))
    assert not marker.exists()
    load_file(str(path), trust=True)
    assert marker.is_dir()  # what --trust-checkpoint would have done: the documented danger


@pytest.mark.integration
@pytest.mark.slow
def test_resume_is_bit_exact_and_files_are_weights_only(tiny_data, tmp_path) -> None:
    """bf16, ZeRO-1: 4 steps == 2 steps + resume + 2 steps; every file holds allowlisted globals only
    (ZeRO-0 fp32: test_training.py::test_resume_continues_exactly; PP: test_scale_out.py, slow)."""
    extra = {"--bf16": True}
    full, half = tmp_path / "full", tmp_path / "half"
    pretrain(_flags(tiny_data, **{"--train-iters": 4, "--tensorboard-dir": full, **extra}))
    pretrain(_flags(tiny_data, **{"--train-iters": 2, "--lr-decay-iters": 4, "--save": half / "ckpt",
                                  "--tensorboard-dir": half / "tb1", **extra}))
    files = [p for p in (half / "ckpt" / "iter_0000002").rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files), files  # no pickle at all
    pretrain(_flags(tiny_data, **{"--train-iters": 4, "--load": half / "ckpt",
                                  "--tensorboard-dir": half / "tb2", **extra}))
    expected = read_scalars(full, "train/lm_loss")
    resumed = {**read_scalars(half / "tb1", "train/lm_loss"), **read_scalars(half / "tb2", "train/lm_loss")}
    assert sorted(resumed) == [1, 2, 3, 4] and [expected[s] for s in range(1, 5)] == [resumed[s] for s in
                                                                                      range(1, 5)]


# ---------------------------------------------------------------------------- 2. never a NaN checkpoint
@pytest.mark.integration
def test_non_finite_state_is_never_saved(tiny_data, tmp_path) -> None:
    """SGD at ZeRO-0 fp32 (the one path where a non-finite gradient is not skipped: tests/test_skip_step.py)
    diverges to non-finite weights, which are never saved."""
    save = tmp_path / "ckpt"
    flags = _flags(tiny_data, **{"--lr": 1e12, "--lr-warmup-iters": 0, "--clip-grad": 0, "--train-iters": 8,
                                 "--save": save, "--save-interval": 1, "--log-interval": 100,
                                 "--optimizer": "sgd", "--zero-stage": 0})
    proc = pretrain(flags, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: not saving a non-finite training state"), proc.stderr[-2000:]
    tags = sorted(p.name for p in save.glob("iter_*"))
    for tag in tags:
        weights = ShardIndex(str(save / tag)).full("fp32")
        assert weights and all(torch.isfinite(t).all() for t in weights.values()), tag
    if tags:
        assert (save / "latest").read_text() == tags[-1] and f"{save / tags[-1]}" in last
    else:
        assert "no good checkpoint was saved" in last


# ---------------------------------------------------------------------------- 3. atomic tags, disk full
def _limit_file_size(limit: int):
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.integration
def test_full_disk_leaves_no_torn_tag_and_names_the_last_complete_one(tiny_data, ckpt) -> None:
    stale = ckpt / "iter_0000003.tmp"  # a save that crashed: ignored on load, removed by the next save
    stale.mkdir()
    (stale / MODEL_STATES).write_bytes(b"torn")
    cmd = [sys.executable, "-m", "megapost.pretrain",
           *_flags(tiny_data, **{"--train-iters": 4, "--load": ckpt, "--save": ckpt})]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_file_size(200_000))  # the model states file is ~600 kB
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "resumed from" in proc.stdout, text[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    head = "error: checkpoint iter_0000004 not saved: rank 0: file size limit reached on /"
    assert last.startswith(head), text[-3000:]
    assert f"writing {ckpt / 'iter_0000004.tmp'}/" in last
    assert f"; the last complete checkpoint is {ckpt / 'iter_0000002'};" in last, last
    assert last.endswith("; 'latest' still names iter_0000002"), last
    assert "Traceback" not in text and not stale.exists()
    assert not (ckpt / "iter_0000004").exists() and (ckpt / "latest").read_text() == "iter_0000002"
    # the next save (no limit) cleans the torn temp tag and completes
    pretrain(_flags(tiny_data, **{"--train-iters": 4, "--load": ckpt, "--save": ckpt}))
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000002",
                                                                                   "iter_0000004"]
    assert (ckpt / "latest").read_text() == "iter_0000004"


def test_no_space_left_on_device_is_one_line(tmp_path) -> None:
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    target = tmp_path / "iter_0000004.tmp" / MODEL_STATES
    target.parent.mkdir()
    target.symlink_to("/dev/full")
    with pytest.raises(OSError) as info:
        SafeCheckpointEngine().save({"w": torch.ones(1 << 16)}, str(target))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    msg = str(write_error(info.value, str(target), "ckpt/iter_0000002").code)
    assert msg.startswith("error: no space left on /") and f"writing {target}" in msg
    assert msg.endswith("; the last complete checkpoint is ckpt/iter_0000002")
    shard = tmp_path / "iter_0000004.tmp" / "shard.safetensors"  # megapost's streamed shard writer too
    temp_path_for(shard).symlink_to("/dev/full")  # the temp file it writes before renaming
    with pytest.raises(OSError) as info:
        write_safetensors(str(shard), [("w", torch.ones(1 << 16))], {}, fsync=False)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(shard)
    assert not shard.exists()


# ---------------------------------------------------------------------------- 4. one-line errors
@pytest.mark.integration
def test_checkpoint_of_another_model_is_refused_naming_both_shapes(tiny_data, ckpt) -> None:
    msg = _error(_flags(tiny_data, **{"--load": ckpt, "--hidden-size": 128}))
    assert "2 layers x 64 hidden, ffn 128, 4 heads, vocab 512, post-norm" in msg
    assert "2 layers x 128 hidden, ffn 128, 4 heads, vocab 512, post-norm" in msg
    msg = _error(_flags(tiny_data, **{"--load": ckpt, "--norm-position": "pre"}))
    assert "post-norm" in msg and "pre-norm" in msg
    msg = _error(_flags(tiny_data, **{"--load": ckpt, "--make-vocab-size-divisible-by": 1024}))
    assert "vocab 512" in msg and "vocab 1024" in msg
    msg = _error(_flags(tiny_data, **{"--save": ckpt, "--num-layers": 3}))
    assert msg.startswith(f"error: --save {ckpt} already holds a checkpoint of another model") and \
        "3 layers x 64 hidden" in msg and "--run-name" in msg


@pytest.mark.integration
def test_broken_checkpoint_files_are_one_line(tiny_data, ckpt, ckpt_ds) -> None:
    flags = _flags(tiny_data, **{"--train-iters": 4, "--load": ckpt})
    meta = ckpt / "iter_0000002" / META_FILE
    good = meta.read_bytes()
    meta.write_bytes(good[: len(good) // 2])
    msg = _error(flags)
    assert str(meta) in msg and "truncated or not valid JSON" in msg
    meta.write_bytes(good)
    shard = next((ckpt / "iter_0000002" / "layout_free").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:50_000])
    msg = _error(flags)  # the manifest sees the wrong size before anything is read
    assert "incomplete" in msg and f"truncated (layout_free/{shard.name})" in msg
    shutil.rmtree(ckpt / "iter_0000002" / "layout_free")
    assert "holds no checkpoint files" in _error(flags)
    ckpt = ckpt_ds  # --ckpt-format deepspeed: DeepSpeed's pickled files as well
    flags = _flags(tiny_data, **{"--train-iters": 4, "--load": ckpt})
    states = ckpt / "iter_0000002" / MODEL_STATES
    states.write_bytes(states.read_bytes()[:100_000])
    msg = _error(flags)  # the tag's manifest (layout_free/) sees the wrong size first
    assert "incomplete" in msg and f"truncated ({states.name})" in msg
    shutil.rmtree(ckpt / "iter_0000002" / "layout_free")  # a tag without one: the pre-scan finds it
    msg = _error(flags)
    assert str(states) in msg and "truncated or corrupt" in msg
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        SafeCheckpointEngine().load(str(states))
    # an empty 'latest', or one naming a missing tag, falls back to the newest tag: its broken file named
    (ckpt / "latest").write_text("")
    assert str(states) in _error(flags)
    (ckpt / "latest").write_text("iter_0000009")
    assert str(states) in _error(flags)


@pytest.mark.parametrize("flag, value", [("--train-iters", -5), ("--micro-batch-size", 0),
                                         ("--eval-iters", -1)])
def test_non_positive_counts_are_one_line(tiny_data, flag, value) -> None:
    assert f"{flag} {value}: must be" in _error(tiny_model_flags(tiny_data, **{flag: value}))


@pytest.mark.integration
def test_bad_layout_is_printed_once_by_the_launcher(tiny_data, tmp_path) -> None:
    """TP 3 on 3 ranks with 4 heads: one line from one rank, before any process group forms."""
    flags = tiny_model_flags(tiny_data, **{"--tensor-model-parallel-size": 3, "--global-batch-size": 2,
                                           "--micro-batch-size": 2})
    proc = pretrain(flags, nprocs=3, check=False, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    errors = [line for line in text.splitlines() if "error: invalid parallel layout" in line]
    assert len(errors) == 1 and "--num-attention-heads 4 is not divisible by" in errors[0], text[-3000:]
    assert "Traceback" not in text


def test_finite_check_agrees_with_an_elementwise_mask() -> None:
    """all_finite (min/max reduction) against torch.isfinite on every element, bad values anywhere."""
    import torch

    from megapost.checkpoint.finite_guard import all_finite

    gen = torch.Generator().manual_seed(0)
    for bad in (float("nan"), float("inf"), float("-inf"), None):
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((), (1,), (7, 5), (1000,)):
                t = torch.randn(shape, generator=gen).to(dtype)
                if bad is not None:
                    t.view(-1)[int(torch.randint(t.numel(), (1,), generator=gen))] = bad
                want = bool(torch.isfinite(t).all())
                assert all_finite([t, torch.zeros(0), torch.arange(3), 2.5], torch.device("cpu")) == want
