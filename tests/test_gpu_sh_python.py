"""benchmarks/gpu.sh uses the torch a GPU box already has (issue 38): there, ``python3`` on PATH was an
image's venv holding the CUDA torch, with ``VIRTUAL_ENV`` unset and no network. Rebuilt on CPU: a venv
holding torch and DeepSpeed first on PATH, VIRTUAL_ENV unset, PIP_NO_INDEX=1."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_gpu_script import REPO, fresh_venv

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]  # runs gpu.sh


def image_box(tmp_path: Path) -> dict[str, str]:
    """The environment of that box: a venv python3 with torch + DeepSpeed first on PATH, not activated,
    offline for pip."""
    env = fresh_venv(tmp_path)
    env.pop("VIRTUAL_ENV")
    env["PIP_NO_INDEX"] = "1"
    return env


def gpu_sh(args: list[str], env: dict[str, str], cwd: Path = REPO,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu.sh", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_python3_that_has_the_torch_is_used_as_it_is(tmp_path) -> None:
    env = image_box(tmp_path)
    proc = gpu_sh(["--dry-run", "--print-python", "--venv", str(tmp_path / "made")], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "venv" / "bin" / "python3")
    assert not (tmp_path / "made").exists()


def test_a_venv_made_from_a_venv_python3_sees_its_packages(tmp_path) -> None:
    """Without CUDA, python3's torch does not serve a GPU run: gpu.sh makes its own venv from python3,
    and that venv imports python3's torch and DeepSpeed (a plain --system-site-packages would show only
    the base interpreter's packages)."""
    env = image_box(tmp_path)
    made = tmp_path / "made"
    proc = gpu_sh(["--print-python", "--venv", str(made)], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"{made}/bin/python"
    probe = subprocess.run([f"{made}/bin/python", "-c", "import torch, deepspeed; print(torch.__file__)"],
                           env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr


def test_offline_without_a_torch_fails_in_one_line_within_seconds(tmp_path) -> None:
    bare = tmp_path / "bare"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON")}
    env.update(PYTHON=f"{bare}/bin/python", PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    proc = gpu_sh([], env, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr


@pytest.mark.slow  # ~4 min on 2 cores: an editable install and the whole suite at tiny shapes
def test_dry_run_on_the_rebuilt_box_finishes(tmp_path) -> None:
    env = image_box(tmp_path)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    out = tmp_path / "suite.json"
    proc = gpu_sh(["--dry-run", "--out", str(out)], env, cwd=clone, timeout=1500)
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    assert "already has the torch this run needs" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows and not [r["case"] for r in rows if "error" in r]
