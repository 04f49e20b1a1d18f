"""The collapse record survives a resume at another layout: a Post-Norm run that collapses, stopped
after its alarm and resumed on two data-parallel ranks, ends with the same record as the run that was
never interrupted -- the alarm step (TensorBoard and the plugin state), the transition, the alarm's
marks and the heatmap history (the measured steps and, before the stop, their values)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from launch_utils import pretrain, read_scalars, tiny_model_flags

from megapost.checkpoint import codec, format

pytestmark = pytest.mark.integration  # three short runs, one of them on 2 ranks

ITERS, STOP = 10, 6


def _flags(data, out: Path, ckpt: Path, **extra) -> list[str]:
    """tests/test_collapse_alarm.py's collapsing Post-Norm run: the alarm by step ~4."""
    return tiny_model_flags(data, **{
        "--norm-position": "post", "--num-layers": 12, "--hidden-size": 32, "--ffn-hidden-size": 96,
        "--micro-batch-size": 4, "--global-batch-size": 4, "--train-iters": ITERS, "--lr": 0.1,
        "--min-lr": 0.1, "--lr-warmup-iters": 0, "--init-variance": "paper", "--seed": 1,
        "--log-interval": 100, "--tensorboard-dir": out, "--plugins": "collapse_metrics",
        "--collapse-interval": 2, "--collapse-image-interval": 1, "--save": ckpt, "--load": ckpt,
        "--save-interval": STOP, **extra})


def _record(ckpt: Path) -> dict:
    """The plugin's state in the checkpoint of the last step (the logging rank's record)."""
    header, tensors = format.read_state(str(ckpt / f"iter_{ITERS:07d}"))
    return codec.decode(header["plugins"], tensors)["collapse_metrics"]


def _steps(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "collapse_metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def test_record_continues_across_a_resume_at_two_ranks(tiny_data, tmp_path):
    whole = tmp_path / "whole"
    pretrain(_flags(tiny_data, whole, tmp_path / "ckpt-whole"))
    part, ckpt = tmp_path / "part", tmp_path / "ckpt-part"
    pretrain(_flags(tiny_data, part, ckpt, **{"--exit-interval": STOP}))
    first = [r["step"] for r in _steps(part) if r["collapsed"]]
    assert first and first[0] < STOP, "the alarm must come before the stop for this test to mean anything"
    pretrain(_flags(tiny_data, part, ckpt, **{"--micro-batch-size": 2}), nprocs=2)

    alarm = read_scalars(whole, "collapse/alarm/collapsed_at_step")
    assert set(alarm.values()) == {first[0]}  # the uninterrupted run: flagged once, at the same step
    assert read_scalars(part, "collapse/alarm/collapsed_at_step") == alarm  # not restarted at the resume
    a, b = _record(tmp_path / "ckpt-whole"), _record(ckpt)
    assert b["writers"]["alarms"] == a["writers"]["alarms"]  # collapsed and transition: their first steps
    assert b["writers"]["marks"] == a["writers"]["marks"] == [[first[0], "alarm"]]
    assert b["state"]["since"] == a["state"]["since"] == first[0]
    assert b["writers"]["measured"] == a["writers"]["measured"] == ITERS // 2
    images_a, images_b = a["writers"]["images"], b["writers"]["images"]
    assert images_b["steps"] == images_a["steps"] == list(range(2, ITERS + 1, 2))
    before = [i for i, s in enumerate(images_a["steps"]) if s <= STOP]  # one process up to the stop
    np.testing.assert_array_equal(images_b["columns"].numpy()[before], images_a["columns"].numpy()[before])
