"""Machine-readable output is only that, and DeepSpeed's accelerator notice does not repeat per rank: on
a machine without CUDA megapost names the CPU accelerator before DeepSpeed is imported (megapost/__init__),
and `make train` names it for the launcher as well."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from dist_utils import free_port
from launch_utils import REPO, child_env, tiny_model_flags

NOTICE = "Setting accelerator to CPU"


def _env() -> dict[str, str]:
    env = child_env()
    env.pop("DS_ACCELERATOR", None)  # unset: DeepSpeed would probe (and warn)
    return env


@pytest.mark.integration
def test_plan_json_is_only_json() -> None:
    cmd = [sys.executable, "-m", "megapost.plan", "--preset", "tiny-cpu", "--gpus", "1", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(proc.stdout)["model"]  # the whole of stdout parses
    assert NOTICE not in proc.stdout + proc.stderr


@pytest.mark.integration  # a 2-rank launch
def test_one_accelerator_notice_per_launch(tiny_data) -> None:
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 1, "--lr-warmup-iters": 0})
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "megapost.pretrain",
           *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    ranks = out[out.index("spawned with command"):]
    assert NOTICE not in ranks and out.count(NOTICE) <= 2, out[-2000:]  # the launcher's two processes only
    # make train names the accelerator for the launcher too: none at all (megapost's start line says CPU)
    dry = subprocess.run(["make", "-n", "train", "TORCH="], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert "DS_ACCELERATOR=$accel} python -m deepspeed.launcher.runner" in dry


def test_make_train_launches_with_the_chosen_interpreter() -> None:
    """`make train PYTHON=venv/bin/python` runs that venv's deepspeed launcher without the venv activated
    (a bare `deepspeed` was looked up on PATH: 'env: deepspeed: No such file or directory')."""
    dry = subprocess.run(["make", "-n", "train", "TORCH=", "PYTHON=/opt/venv/bin/python"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    launch = next(line for line in dry.splitlines() if "--master_port $port" in line)
    assert "/opt/venv/bin/python -m deepspeed.launcher.runner --master_port" in launch, dry


def test_examples_never_write_over_tracked_figures() -> None:
    """Default output paths of the examples lie under their run root, not in docs/ (tracked files)."""
    for script in sorted((REPO / "examples").glob("*.sh")):
        defaults = re.findall(r"^\w+=\$\{\w+:-([^}]*)\}", script.read_text(), re.M)
        assert not [d for d in defaults if d.startswith("docs/")], script.name


def test_tensorboard_images_read_at_thumbnail_size() -> None:
    """TensorBoard's image card shows a figure scaled to ~500 px wide: there its titles and tick labels
    must stay >= 7 px (they were 4-5 px in a 13-inch figure)."""
    from collapse_metrics.images import DepthImages

    layers = (1, 2, 3)
    images = DepthImages(layers)
    for step in (1, 2):
        images.add(step, [{"layer": n, "sublayer": k, "t_sim_x": 0.5, "t_sim_y": 0.5, "t_sim_out": 0.5,
                           "rms_factor_mean": 1.0, "alpha": 1.0, "c": 1.0, "grad_norm_layer": 1.0,
                           "resid_norm": 1.0} for n in layers for k in ("attn", "ffn")])
    for fig in (images.heatmaps(), images.profiles()):
        width_pt = fig.get_size_inches()[0] * 72
        texts = [t for ax in fig.axes for t in (ax.title, *ax.get_xticklabels()) if t.get_text()]
        sizes = [t.get_fontsize() for t in texts]
        assert sizes and min(sizes) * 500 / width_pt >= 7, (fig.get_size_inches(), min(sizes))
