"""megapost's sharded checkpoint: the streamed safetensors writer, one copy on disk, --async-save (kill -9
during the background write leaves the previous tag loadable, resume bit-exact), --save-retain, and
Megatron's load flags (--finetune, --no-load-optim, --no-load-rng). Single-process runs of the real
trainer; multi-rank layouts are covered by test_reshard.py's chains."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_utils import FAULT_PRETRAIN, REPO, child_env, pretrain, read_scalars, tiny_model_flags
from safetensors import safe_open

from megapost.checkpoint.stream_write import Staging, write_safetensors

TOTAL = 10  # --lr-decay-iters of every run here, so their schedules agree


def _flags(data, **overrides) -> list[str]:
    return tiny_model_flags(data, **{"--lr-decay-iters": TOTAL, **overrides})


def _losses(tb: Path) -> dict[int, float]:
    return read_scalars(tb, "train/lm_loss")


def _tags(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))


def test_stream_writer_round_trips_through_safe_open(tmp_path) -> None:
    entries = [("a", torch.randn(3, 5)), ("b", torch.arange(7)), ("c", torch.randn(4).bfloat16()),
               ("d", torch.tensor(3.0)), ("e", torch.zeros(0)), ("f", torch.randn(6, 4)[:, :2]),
               ("g", torch.randn(1000))]
    path = tmp_path / "x.safetensors"
    write_safetensors(str(path), entries, {"megapost": "{}"}, Staging(nbytes=64))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"megapost": "{}"}
        for name, t in entries:
            assert torch.equal(f.get_tensor(name), t), name


def _state_bytes(tag: Path) -> int:
    """Training state of a ZeRO-0 fp32 run: fp32 weights + two Adam moments (12 bytes a parameter),
    the parameter count from the model's own shapes."""
    from megapost.checkpoint.reader import ShardIndex

    shapes = ShardIndex(str(tag)).shapes
    return 12 * sum(math.prod(s) for s in shapes.values())


@pytest.mark.integration
def test_async_save_retention_kill9_and_exact_resume(tiny_data, tmp_path) -> None:
    # 10 async saves, --save-retain 3: exactly the newest 3 complete tags remain; one copy on disk
    ref = tmp_path / "ref"
    pretrain(_flags(tiny_data, **{"--train-iters": TOTAL, "--save": ref / "ckpt", "--save-interval": 1,
                                  "--save-retain": 3, "--async-save": True, "--tensorboard-dir": ref / "tb"}))
    assert _tags(ref / "ckpt") == ["iter_0000008", "iter_0000009", "iter_0000010"]
    assert (ref / "ckpt" / "latest").read_text() == "iter_0000010"
    tag = ref / "ckpt" / "iter_0000010"
    written = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
    ratio = written / _state_bytes(tag)
    print(f"bytes written per save / training-state bytes: {ratio:.4f}")
    assert 1.0 <= ratio <= 1.05 and not list(tag.glob("*.pt"))
    expected = _losses(ref / "tb")
    # kill -9 while the background write of iteration 4 is half done: iteration 2 stays the checkpoint
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, FAULT_PRETRAIN, "--slow-save", "4:300",
           *_flags(tiny_data, **{"--train-iters": TOTAL, "--save": ckpt, "--save-interval": 2,
                                 "--async-save": True})]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = ckpt / "iter_0000004.tmp" / "layout_free"
    deadline = time.time() + 300
    try:
        while not (partial.is_dir() and any(n.startswith(".shard") for n in os.listdir(partial))):
            assert proc.poll() is None and time.time() < deadline, "the run ended before the slow save"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (ckpt / "latest").read_text() == "iter_0000002" and not (ckpt / "iter_0000004").exists()
    out = pretrain(_flags(tiny_data, **{"--train-iters": 6, "--load": ckpt, "--save": ckpt,
                                        "--tensorboard-dir": tmp_path / "tb2"}))
    assert f"resumed from {ckpt} at iteration 2" in out.stdout
    resumed = _losses(tmp_path / "tb2")
    assert sorted(resumed) == [3, 4, 5, 6] and all(resumed[s] == expected[s] for s in resumed)
    assert _tags(ckpt) == ["iter_0000002", "iter_0000006"]  # the torn temp tag was removed


@pytest.mark.integration
def test_async_snapshot_is_taken_before_the_next_optimizer_step(tiny_data, tmp_path) -> None:
    # the background thread copies the state while step 3 runs; --slow-snapshot (the fault harness) stalls it
    # after its first tensor for 2 s, so without the wait at the optimizer step the rest of iteration 2's
    # snapshot would hold step 3's weights and moments: resuming from it must match the run bit for bit
    ckpt = tmp_path / "ckpt"
    out = pretrain(_flags(tiny_data, **{"--train-iters": 4, "--save": ckpt, "--save-interval": 2,
                                        "--async-save": True, "--tensorboard-dir": tmp_path / "tb"}),
                   faults=["--slow-snapshot", "2:2"])
    assert "saving checkpoint (in the background)" in out.stdout
    expected = _losses(tmp_path / "tb")
    (ckpt / "latest").write_text("iter_0000002")
    pretrain(_flags(tiny_data, **{"--train-iters": 4, "--load": ckpt, "--tensorboard-dir": tmp_path / "tb2"}))
    resumed = _losses(tmp_path / "tb2")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == expected[s] for s in resumed)


@pytest.mark.integration
def test_megatron_load_flags(tiny_data, tmp_path) -> None:
    """--finetune: the weights only (iteration 0, fresh schedule); --no-load-optim: the iteration goes
    on, optimizer and schedule start fresh (Megatron's meaning); --no-load-rng with it."""
    first = tmp_path / "first"
    pretrain(_flags(tiny_data, **{"--train-iters": 3, "--save": first / "ckpt", "--tensorboard-dir": first}))
    lr_fresh, loss_fresh = read_scalars(first, "train/lr"), _losses(first)
    tune = tmp_path / "tune"
    out = pretrain(_flags(tiny_data, **{"--train-iters": 2, "--load": first / "ckpt", "--finetune": True,
                                        "--tensorboard-dir": tune}))
    assert f"resumed from {first / 'ckpt'} at iteration 0 (0 samples)" in out.stdout
    assert sorted(_losses(tune)) == [1, 2] and read_scalars(tune, "train/lr")[1] == lr_fresh[1]
    assert _losses(tune)[1] < loss_fresh[1]  # the same first batch, on the trained weights
    cont = tmp_path / "cont"
    out = pretrain(_flags(tiny_data, **{"--train-iters": 5, "--load": first / "ckpt", "--no-load-optim": True,
                                        "--no-load-rng": True, "--tensorboard-dir": cont}))
    assert f"resumed from {first / 'ckpt'} at iteration 3" in out.stdout
    assert sorted(_losses(cont)) == [4, 5] and read_scalars(cont, "train/lr")[4] == lr_fresh[1]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_sgd_momentum_resume_is_bit_exact(tiny_data, tmp_path, bf16) -> None:
    """--optimizer sgd: every tensor of the optimizer state is saved (the momentum buffers), so a resume
    continues bit for bit (bf16: through DeepSpeed's fp32 partitions)."""
    sgd = {"--optimizer": "sgd", "--sgd-momentum": 0.9, "--lr": 0.05, **({"--bf16": True} if bf16 else {})}
    pretrain(_flags(tiny_data, **{**sgd, "--train-iters": 6, "--tensorboard-dir": tmp_path / "ref"}))
    expected = _losses(tmp_path / "ref")
    ckpt = tmp_path / "ckpt"
    pretrain(_flags(tiny_data, **{**sgd, "--train-iters": 3, "--save": ckpt,
                                  "--tensorboard-dir": tmp_path / "a"}))
    shard = ckpt / "iter_0000003" / "layout_free" / "shard-tp00-pp00-dp00.safetensors"
    with safe_open(str(shard), "pt") as f:
        assert any(k.startswith("momentum_buffer/") for k in f.keys())
    pretrain(_flags(tiny_data, **{**sgd, "--train-iters": 6, "--load": ckpt,
                                  "--tensorboard-dir": tmp_path / "b"}))
    resumed = _losses(tmp_path / "b")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == expected[s] for s in resumed), (resumed,
                                                                                            expected)
