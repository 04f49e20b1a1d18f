"""Machine-readable output is only that, and DeepSpeed's accelerator notice does not repeat per rank: on
a machine without CUDA megapost names the CPU accelerator before DeepSpeed is imported (megapost/__init__),
and `make train` names it for the launcher as well."""

from __future__ import annotations

import json
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


def test_plan_json_is_only_json() -> None:
    cmd = [sys.executable, "-m", "megapost.plan", "--preset", "tiny-cpu", "--gpus", "1", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(proc.stdout)["model"]  # the whole of stdout parses
    assert NOTICE not in proc.stdout + proc.stderr


@pytest.mark.slow  # a 2-rank launch
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
    assert "DS_ACCELERATOR=$accel} deepspeed" in dry
