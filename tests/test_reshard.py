"""Checkpoints that travel: a checkpoint saved at one (TP, PP, DP, ZeRO, bf16, SP) layout resumes at
another through megapost's layout-free state, continuing with the losses of an uninterrupted run;
a checkpoint that lost a rank's files is refused in one line.

Each chain runs N steps per segment through the real trainer (DeepSpeed's launcher for > 1 rank),
each segment loading the previous one's checkpoint at a new layout, and compares the per-step losses
with one uninterrupted single-process run of all the steps (layouts agree to ~1e-6 in fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_utils import pretrain, read_scalars, tiny_model_flags

STEPS = 2  # per segment


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
    """(chained losses, uninterrupted losses) over len(layouts) * STEPS steps."""
    total = STEPS * len(layouts)
    common = {"--lr-decay-iters": total, "--save": tmp / "ckpt", "--bf16": bf16}
    chained: list[float] = []
    for k, layout in enumerate(layouts):
        layout = dict(layout)
        world = layout.pop("_world")
        tb = tmp / f"seg{k}"
        flags = _flags(data, **{**common, **layout, "--train-iters": STEPS * (k + 1), "--tensorboard-dir": tb,
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
