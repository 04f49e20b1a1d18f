"""Checkpoints that travel: a checkpoint saved at one (TP, PP, DP, ZeRO, bf16, SP) layout resumes at
another through megapost's layout-free state, continuing with the losses of an uninterrupted run;
a checkpoint that lost a rank's files is refused in one line.

Each chain runs N steps per segment through the real trainer (DeepSpeed's launcher for > 1 rank),
each segment loading the previous one's checkpoint at a new layout, and compares the per-step losses
with one uninterrupted single-process run of all the steps (layouts agree to ~1e-6 in fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_faults import full_tensors
from dist_utils import run_ranks
from launch_utils import pretrain, read_scalars, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

STEPS = 2  # per segment; the last segment continues for LAST_STEPS (the 10-step criterion)
LAST_STEPS = 10


def _flags(data, **overrides) -> list[str]:
    return tiny_model_flags(data, **{"--zero-stage": 1, "--peak-tflops": 1, "--lr-warmup-iters": 1,
                                     **overrides})


def _losses(tb: Path) -> list[float]:
    values = read_scalars(tb, "train/lm_loss")
    return [values[s] for s in sorted(values)]


def _layout(tp: int, pp: int, dp: int, zero: int = 1, sp: bool = False, bf16: bool = False) -> dict:
    return {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp, "--zero-stage": zero,
            "--sequence-parallel": sp, "--bf16": bf16, "_world": tp * pp * dp}


def _chain(data, tmp: Path, layouts: list[dict], bf16: bool = False) -> tuple[list[float], list[float]]:
    """(chained losses, uninterrupted losses): STEPS per segment, LAST_STEPS at the last layout."""
    ends = [STEPS * (k + 1) for k in range(len(layouts) - 1)]
    ends.append((ends[-1] if ends else 0) + LAST_STEPS)
    total = ends[-1]
    common = {"--lr-decay-iters": total, "--save": tmp / "ckpt", "--bf16": bf16}
    chained: list[float] = []
    for k, layout in enumerate(layouts):
        layout = dict(layout)
        world = layout.pop("_world")
        tb = tmp / f"seg{k}"
        flags = _flags(data, **{**common, **layout, "--train-iters": ends[k], "--tensorboard-dir": tb,
                                "--load": tmp / "ckpt" if k else None})
        out = pretrain(flags, nprocs=world, timeout=900)
        if k:
            assert f"resumed from {tmp / 'ckpt'} at iteration {STEPS * k}" in out.stdout
        chained += _losses(tb)
    full = _flags(data, **{"--lr-decay-iters": total, "--train-iters": total, "--bf16": bf16,
                           "--tensorboard-dir": tmp / "full"})
    pretrain(full, nprocs=1, timeout=900)
    return chained, _losses(tmp / "full")


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_reshard_chain_tp_sp_dp_zero(tiny_data, tmp_path) -> None:
    """(2,1,1)+SP ZeRO-1 -> (1,1,2) ZeRO-2 -> (1,1,1) ZeRO-0, against one uninterrupted run."""
    chained, full = _chain(tiny_data, tmp_path, [_layout(2, 1, 1, sp=True), _layout(1, 1, 2, zero=2),
                                                 _layout(1, 1, 1, zero=0)])
    print("max rel loss diff", _max_rel(chained, full))
    assert chained == pytest.approx(full, rel=1e-5)
    _check_partial_refused(tiny_data, tmp_path / "ckpt")


def _check_partial_refused(data, ckpt: Path) -> None:
    """A tag that lost one rank's file (layout-free shard, then DeepSpeed's model file) is refused
    with one line before any process group forms."""
    import shutil

    tag = ckpt / (ckpt / "latest").read_text().strip()
    shards = sorted((tag / "layout_free").glob("shard-*.safetensors"))
    for lost in shards[:1] + sorted(tag.glob("*model_states.pt"))[:1]:
        broken = ckpt.parent / f"broken-{lost.name}"
        shutil.copytree(ckpt, broken)
        (broken / tag.name / lost.relative_to(tag)).unlink()
        proc = pretrain(_flags(data, **{"--load": broken, "--train-iters": 20}), check=False, timeout=300)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "incomplete" in line]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
        assert errors[0].startswith("error: --load ") and lost.name in errors[0], errors


@pytest.mark.slow
def test_reshard_chain_tp_pp_dp(tiny_data, tmp_path) -> None:
    """(2,2,1) ZeRO-1 -> (1,1,2) ZeRO-1 -> (1,2,1) -> (1,1,1)."""
    chained, full = _chain(tiny_data, tmp_path, [_layout(2, 2, 1), _layout(1, 1, 2), _layout(1, 2, 1),
                                                 _layout(1, 1, 1)])
    print("max rel loss diff", _max_rel(chained, full))
    assert chained == pytest.approx(full, rel=1e-5)


@pytest.mark.slow
def test_reshard_zero2_and_sp_back(tiny_data, tmp_path) -> None:
    """(1,1,2) ZeRO-2 -> (1,1,1) -> (2,1,1)+SP -> (1,1,1)."""
    chained, full = _chain(tiny_data, tmp_path, [_layout(1, 1, 2, zero=2), _layout(1, 1, 1),
                                                 _layout(2, 1, 1, sp=True), _layout(1, 1, 1)])
    print("max rel loss diff", _max_rel(chained, full))
    assert chained == pytest.approx(full, rel=1e-5)


def _tag(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def _state_header(tag: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(tag / "layout_free" / "state.safetensors"), framework="pt") as f:
        return json.loads(f.metadata()["megapost"])


def _load_then_save(argv: list[str]) -> None:
    """One rank: build the run ``argv`` describes (its --load resumed) and save it before any step."""
    from megapost.train.build import build
    from megapost.train.prepare import prepare

    trainer = build(prepare(argv))
    try:
        trainer.save()
        trainer.checkpoints.wait()
    finally:
        trainer.close()


@pytest.mark.slow
def test_reshard_bf16(tiny_data, tmp_path) -> None:
    """bf16 (1,1,2) ZeRO-1 (DP-partitioned fragments) resumed at (2,1,1) TP2 (tensor-split, bf16
    optimizer): the state the resumed run holds, saved again before it trains, equals the saved one
    tensor by tensor and bit for bit — every fp32 master and both Adam moments of every parameter — with
    the same Adam step and lr schedule. A moment or slice put in the wrong place fails it."""
    first = _flags(tiny_data, **{"--bf16": True, "--lr-decay-iters": 2 * STEPS, "--train-iters": STEPS,
                                 "--save": tmp_path / "ckpt"})
    pretrain(first, nprocs=2, timeout=900)
    again = _flags(tiny_data, **{"--bf16": True, "--lr-decay-iters": 2 * STEPS, "--train-iters": STEPS,
                                 "--load": tmp_path / "ckpt", "--save": tmp_path / "again",
                                 "--tensor-model-parallel-size": 2})
    run_ranks(_load_then_save, 2, [str(f) for f in again], timeout=900)  # the trainer's build and save
    saved, resumed = full_tensors(_tag(tmp_path / "ckpt")), full_tensors(_tag(tmp_path / "again"))
    assert saved.keys() == resumed.keys() and len(saved) == 3 * len({k.split("/", 1)[1] for k in saved})
    for key, tensor in saved.items():
        assert not tensor.isnan().any(), f"{key}: elements no shard of the saved tag holds"
        assert torch.equal(resumed[key], tensor), f"{key}: resumed at TP2 differs from the saved state"
    assert all(saved[f"exp_avg_sq/{k.split('/', 1)[1]}"].abs().sum() > 0 for k in saved)  # Adam state lives
    a, b = _state_header(_tag(tmp_path / "ckpt")), _state_header(_tag(tmp_path / "again"))
    assert a["adam_step"] == b["adam_step"] == STEPS and a["scheduler"] == b["scheduler"], (a, b)
