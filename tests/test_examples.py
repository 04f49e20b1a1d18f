"""The documented entry points: `deepspeed examples/pretrain_postnorm.sh`, two ranks, and bash."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dist_utils import free_port
from launch_utils import read_scalars, run, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs


def _flags(data) -> list[str]:
    return tiny_model_flags(data, **{"--train-iters": 4, "--eval-interval": 2, "--eval-iters": 1})


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss (\d+\.\d+) \| lr", stdout)]


@pytest.mark.parametrize("script", ["pretrain_postnorm.sh",
                                    pytest.param("pretrain_prenorm.sh", marks=pytest.mark.slow)])
def test_deepspeed_launcher_runs_the_example(tiny_data, tmp_path, script) -> None:
    out = run(["deepspeed", "--master_port", str(free_port()), f"examples/{script}", *_flags(tiny_data)],
              MEGAPOST_RUN_DIR=str(tmp_path))
    name = script.removeprefix("pretrain_").removesuffix(".sh")
    assert f"norm={name.removesuffix('norm')}" in out.stdout
    run_dir = _only_run(tmp_path)
    assert run_dir.name.startswith(f"{name}-") and f"run directory: {run_dir}" in out.stdout
    assert len(read_scalars(run_dir / "tensorboard", "train/lm_loss")) == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000004"


def _only_run(runs: Path) -> Path:
    """The single run directory under ``runs`` (``latest`` points at it)."""
    dirs = [p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(dirs) == 1, dirs
    assert (runs / "latest").read_text().strip() == dirs[0].name  # a file: TensorBoard sees no second run
    return dirs[0]


def test_two_ranks_and_bash_give_the_same_losses(tiny_data, tmp_path) -> None:
    """Data parallelism over 2 ranks (gloo) reproduces the single-process run."""
    two = run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
               "examples/pretrain_postnorm.sh", *_flags(tiny_data)], MEGAPOST_RUN_DIR=str(tmp_path / "a"))
    assert "(TP,PP,DP)=(1,1,2)" in two.stdout
    _only_run(tmp_path / "a")  # both ranks agreed on the default run name
    one = run(["bash", "examples/pretrain_postnorm.sh", *_flags(tiny_data)],
              MEGAPOST_RUN_DIR=str(tmp_path / "b"))
    assert len(_losses(one.stdout)) == 4
    assert _losses(two.stdout) == pytest.approx(_losses(one.stdout), rel=1e-5)
