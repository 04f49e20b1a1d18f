"""examples/slurm/pretrain_paper_180m.sbatch end to end, with stand-ins for SLURM's `srun` (starts
SLURM_NTASKS tasks with their SLURM_* variables, passes signals on, as srun does) and `scontrol`:
USR1 before the time limit -> the tasks save and exit 0 -> the job requeues; the requeued run resumes
from `latest`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from launch_utils import REPO, child_env, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for p in "${pids[@]}"; do while :; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done; \
  [ "$r" = 0 ] || rc=$r; done
exit $rc
"""
SCONTROL = """#!/bin/bash
case "$1" in show) echo localhost ;; requeue) echo "$2" >> "$REQUEUED" ;; esac
"""


def _shims(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.slow  # two ranks, signalled mid-run, then resumed: ~1-2 min on 2 cores
def test_sbatch_requeues_on_the_signal_and_resumes_from_latest(tiny_data, tmp_path) -> None:
    save, requeued = tmp_path / "ckpt", tmp_path / "requeued"
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 400, "--data-path": None,
                                           "--tokenizer-model": None}) + ["--no-bf16"]
    env = child_env(PATH=f"{_shims(tmp_path)}:{os.environ['PATH']}", SLURM_JOB_ID="99", SLURM_NTASKS="2",
                    SLURM_JOB_NODELIST="localhost", DATA=tiny_data.prefix,
                    TOKENIZER=tiny_data.tokenizer_model,
                    SAVE=str(save), PYTHON=sys.executable, REQUEUED=str(requeued),
                    MASTER_PORT=str(free_port()))
    script = str(REPO / "examples/slurm/pretrain_paper_180m.sbatch")
    job = subprocess.Popen(["bash", script, *flags], cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in job.stdout:  # wait for training to be under way, then the time-limit signal
        lines.append(line)
        if "iteration      3/" in line:
            job.send_signal(signal.SIGUSR1)
            break
    lines += job.stdout.readlines()
    assert job.wait(120) == 0, "".join(lines[-40:])
    assert requeued.read_text().split() == ["99"]
    stopped = int((save / "latest").read_text().strip().removeprefix("iter_"))
    assert 3 <= stopped < 400, "".join(lines[-20:])
    env["MASTER_PORT"] = str(free_port())
    time.sleep(1)
    again = subprocess.run(["bash", script, *flags, "--exit-interval", str(stopped + 2)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"iteration {stopped + 1:6d}/" in again.stdout and "iteration      1/" not in again.stdout


def _sbatch(tmp: Path, flags: list[str], data, **env: str) -> subprocess.CompletedProcess:
    """The sbatch as SLURM starts it, one task, with ``flags`` after its own (later flags win)."""
    env = child_env(PATH=f"{_shims(tmp)}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_NTASKS="1",
                    SLURM_JOB_NODELIST="localhost", DATA=data.prefix, TOKENIZER=data.tokenizer_model,
                    SAVE=str(tmp / "ckpt"), REQUEUED=str(tmp / "requeued"), MASTER_PORT=str(free_port()),
                    **env)
    return subprocess.run(["bash", str(REPO / "examples/slurm/pretrain_paper_180m.sbatch"), *flags], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=600)


def test_sbatch_records_the_collapse_study(tiny_data, tmp_path) -> None:
    """Its own flags (collapse_metrics every 10 steps) on a tiny Post-Norm model that collapses within a
    few steps (tests/test_collapse_alarm.py's settings): the metrics file and the alarm."""
    tb = tmp_path / "tb"
    flags = tiny_model_flags(tiny_data, **{
        "--num-layers": 12, "--hidden-size": 32, "--ffn-hidden-size": 96, "--micro-batch-size": 4,
        "--global-batch-size": 4, "--train-iters": 10, "--lr": 0.1, "--min-lr": 0.1, "--lr-warmup-iters": 0,
        "--init-variance": "paper", "--seed": 1, "--log-interval": 100, "--tensorboard-dir": tb,
        "--data-path": None, "--tokenizer-model": None}) + ["--no-bf16"]
    proc = _sbatch(tmp_path, flags, tiny_data, PYTHON=sys.executable)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [json.loads(line) for line in (tb / "collapse_metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in steps}) == [10]  # the sbatch's --collapse-interval 10
    assert "[collapse] COLLAPSED at step 10" in proc.stdout
    assert "deprecated" not in proc.stderr


def test_sbatch_old_interpreter_variable_still_works_with_a_note(tiny_data, tmp_path) -> None:
    proc = _sbatch(tmp_path, ["--version-of-nothing"], tiny_data, MEGAPOST_PYTHON="/bin/false", PYTHON="")
    assert "MEGAPOST_PYTHON is deprecated; set PYTHON" in proc.stderr and proc.returncode != 0
