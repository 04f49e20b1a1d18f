"""Every placement saves and resumes with the collapse plugin measuring every step (issue 52 item 1:
Hybrid and DyT, whose undefined metrics the plugin records as NaN, stopped at their first save)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_utils import pretrain, tiny_model_flags

from megapost.model.placements import PLACEMENTS

pytestmark = pytest.mark.integration  # two short runs a placement

ITERS, STOP = 4, 2


def _flags(data, ckpt: Path, norm: str, **extra) -> list[str]:
    return tiny_model_flags(data, **{
        "--norm-position": norm, "--train-iters": ITERS, "--log-interval": 100,
        "--plugins": "collapse_metrics", "--collapse-interval": 1, "--save": ckpt, "--load": ckpt,
        "--save-interval": STOP, **extra})


@pytest.mark.parametrize("norm", PLACEMENTS)
def test_placement_saves_and_resumes_with_the_plugin(tiny_data, tmp_path, norm):
    ckpt = tmp_path / "ckpt"
    pretrain(_flags(tiny_data, ckpt, norm, **{"--exit-interval": STOP}))
    assert (ckpt / f"iter_{STOP:07d}").is_dir()
    resumed = pretrain(_flags(tiny_data, ckpt, norm))
    assert f"at iteration {STOP}" in resumed.stdout + resumed.stderr
    assert (ckpt / f"iter_{ITERS:07d}").is_dir()
