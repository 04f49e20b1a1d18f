"""Runs never share a directory unless asked; a resumed run continues its logs without repeats."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from launch_utils import REPO, child_env, pretrain, read_scalars, tiny_model_flags

from megapost.config.arguments import parse_args
from megapost.config.errors import ConfigError
from megapost.runtime.run_dir import apply_named_run


def raw_steps(tb_dir: Path, tag: str) -> list[int]:
    """Every step written for ``tag`` in every event file, in file order (duplicates kept)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


@pytest.mark.integration
def test_unnamed_runs_get_their_own_directories(tiny_data, tmp_path) -> None:
    """Two runs started at once, without --run-name: two directories, neither sees the other's files."""
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 2, "--runs-dir": tmp_path})
    procs = [subprocess.Popen([sys.executable, "-m", "megapost.pretrain", *flags], cwd=REPO, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 2 and all(r.name.startswith("postnorm-") for r in runs)
    for run in runs:
        assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
        assert sorted(read_scalars(run / "tensorboard", "train/lm_loss")) == [1, 2]
        assert sum(f"run directory: {run} (new run)" in out for out in outs) == 1
    latest = tmp_path / "latest"  # a file naming the run: TensorBoard shows no duplicate
    assert tmp_path / latest.read_text().strip() in runs and not latest.is_symlink()


@pytest.mark.integration
def test_resume_continues_tensorboard_and_jsonl_without_repeats(tiny_data, tmp_path) -> None:
    """A run dies at step 6 after a checkpoint at 4; rerunning the same --run-name resumes at 4 and
    the logs hold each step once, increasing (today's failure: steps 5 repeated)."""
    flags = tiny_model_flags(tiny_data, **{"--runs-dir": tmp_path, "--run-name": "r", "--save-interval": 4,
                                           "--plugins": "collapse_metrics", "--collapse-interval": 1})
    first = pretrain(flags + ["--train-iters", "8"], check=False, fail_rank="0:6")
    assert first.returncode != 0 and "fails at iteration 6 on purpose" in first.stderr
    run = tmp_path / "r"
    assert raw_steps(run / "tensorboard", "train/lm_loss") == [1, 2, 3, 4, 5]
    second = pretrain(flags + ["--train-iters", "8"])
    assert f"run directory: {run} (resuming {run / 'checkpoints'})" in second.stdout
    assert "resumed from" in second.stdout and "at iteration 4" in second.stdout
    assert raw_steps(run / "tensorboard", "train/lm_loss") == list(range(1, 9))
    tokens = raw_steps(run / "tensorboard", "train-vs-tokens/lm_loss")
    assert tokens == [s * 4 * 32 for s in range(1, 9)]  # global batch 4 x seq 32
    assert raw_steps(run / "tensorboard", "collapse/t_sim/head") == list(range(1, 9))
    records = [json.loads(line) for line in (run / "tensorboard" / "collapse_metrics.jsonl").open()]
    head = [r["step"] for r in records if "t_sim_head" in r]  # one step record per measured step
    assert head == list(range(1, 9))
    per_step = Counter(r["step"] for r in records)
    assert len(set(per_step.values())) == 1  # every step has the same number of records: no repeats


def test_drop_events_after_keeps_each_tag_up_to_its_resume_point(tmp_path) -> None:
    """Iteration-stepped tags are cut at the iteration, the -vs-tokens tags at the tokens; -1 drops all
    (a named run restarted before its first checkpoint)."""
    from torch.utils.tensorboard import SummaryWriter

    from megapost.metrics.monitor import drop_events_after

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 6):
        writer.add_scalar("train/lm_loss", step, step)
        writer.add_scalar("train-vs-tokens/lm_loss", step, step * 128)
    writer.close()
    assert drop_events_after(str(tmp_path), 3, 3 * 128) == 4
    assert raw_steps(tmp_path, "train/lm_loss") == [1, 2, 3]
    assert raw_steps(tmp_path, "train-vs-tokens/lm_loss") == [128, 256, 384]
    assert drop_events_after(str(tmp_path), -1, -1) == 6 and raw_steps(tmp_path, "train/lm_loss") == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ckpt_step_with_run_name(tmp_path) -> None:
    """--ckpt-step (and --finetune, ...) with --run-name: the named run's checkpoints are the --load; a
    run without one is refused in one line naming it."""
    flags = ["--runs-dir", str(tmp_path), "--run-name", "r1", "--ckpt-step", "4"]
    args = parse_args(flags)  # no --load typed: not refused while the run directory may supply it
    with pytest.raises(ConfigError, match=r"--ckpt-step says what --load restores, but there is no --load "
                                          r"\(--run-name r1: .*r1/checkpoints holds no checkpoint yet\)"):
        apply_named_run(args)
    (tmp_path / "r1" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r1" / "checkpoints" / "latest").write_text("iter_0000006")
    args = parse_args(flags)
    apply_named_run(args)
    assert args.load == str(tmp_path / "r1" / "checkpoints") and args.ckpt_step == 4
