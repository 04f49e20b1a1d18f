"""Scaling out through the real trainer and DeepSpeed's launcher, on CPU over gloo.

* two ``deepspeed`` launchers (a two-"node" hostfile, ``--no_ssh --node_rank``) form one 4-rank world
  whose losses equal one process;
* the embedded example at (TP,PP,DP)=(2,2,1) under ``deepspeed --num_gpus 4``;
* a rank that raises, is killed with SIGKILL, or hangs makes the whole job exit non-zero within a bound
  (``--distributed-timeout-minutes`` also bounds the tensor/pipeline/data groups DeepSpeed creates);
* checkpoints at a parallel layout resume exactly at that layout; one saved before megapost's
  layout-free state existed is refused, one line on every rank, before DeepSpeed reads it, at another
  TP/PP layout (resuming at another layout: tests/test_reshard.py).

Ranks are OS processes on this machine; "nodes" are launcher invocations. Times are wall-clock on a
shared 2-core machine, so the bounds leave a wide margin over the measured values.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from launch_utils import FAULT_PRETRAIN, REPO, child_env, pretrain, read_scalars, run, tiny_model_flags

EXAMPLE = "examples/pretrain_postnorm.sh"
ITERS = 4
TIMEOUT_MIN = 0.5  # --distributed-timeout-minutes of the failure tests: 30 s
LAYOUT_ERROR = "was saved with --"


def _flags(data, **overrides) -> list[str]:
    """Tiny model, fp32, ZeRO-1 (what DeepSpeed's pipeline engine needs; the same on one rank),
    a fixed MFU peak so that no rank spends seconds measuring matmul speed."""
    return tiny_model_flags(data, **{"--train-iters": ITERS, "--zero-stage": 1, "--peak-tflops": 1,
                                     **overrides})


def _losses(tb: Path, tag: str = "train/lm_loss") -> list[float]:
    values = read_scalars(tb, tag)
    return [values[s] for s in sorted(values)]


def _example_flags(data) -> list[str]:
    """With validation every 2 steps (the pipeline engine's eval_batch path)."""
    return _flags(data, **{"--eval-interval": 2, "--eval-iters": 1})


class Job:
    """A launcher running in the background in its own session, its output in a file."""

    def __init__(self, cmd: list[str], log: Path, **env: str) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(**env), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.exit_time: float | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.exit_time is None:
            self.exit_time = time.monotonic()
        return rc

    def rank_pid(self, local_rank: int) -> int:
        """The pid of a rank, from the ``process <pid> spawned with command: [...]`` launcher line."""
        spawned = rf"process (\d+) spawned with command: \[[^\n]*'--local_rank={local_rank}'"
        m = re.search(spawned, self.text())
        assert m, f"no pid for local rank {local_rank} in {self.log}"
        return int(m.group(1))

    def kill(self) -> None:
        """End this job's session (the launcher and the ranks it started), if still there."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _wait(jobs: list[Job], timeout: float, until: str | None = None) -> float:
    """Poll until every job has exited (or, with ``until``, until that text is in a log); returns the
    time it happened. Kills the jobs and fails the test on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [job.poll() is not None for job in jobs]
        if until is not None and any(until in job.text() for job in jobs):
            return time.monotonic()
        if until is None and all(done):
            return max(job.exit_time for job in jobs)  # type: ignore[type-var]
        if until is not None and any(done):
            logs = "\n".join(job.text()[-3000:] for job in jobs)
            raise AssertionError(f"a job ended before {until!r} appeared:\n{logs}")
        time.sleep(0.2)
    for job in jobs:
        job.kill()
    logs = "\n".join(job.text()[-3000:] for job in jobs)
    raise AssertionError(f"still running after {timeout:.0f} s (waiting for {until or 'exit'}):\n{logs}")


def _two_nodes(tmp: Path, target: list[str], **env: str) -> list[Job]:
    """Two launchers on this machine forming one world: hostfile entries 'localhost' and '127.0.0.1'
    (two names DeepSpeed's runner counts as two hosts), 2 slots each, no ssh, rendezvous on 127.0.0.1."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    port = str(free_port())
    return [Job(["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                 "--master_addr", "127.0.0.1", "--master_port", port, *target],
                tmp / f"node{node}.log", **env) for node in (0, 1)]


def _deepspeed(n: int, target: list[str]) -> list[str]:
    return ["deepspeed", "--num_gpus", str(n), "--master_port", str(free_port()), *target]


_reference: dict[str, list[float]] = {}


@pytest.fixture
def example_reference(tiny_data, tmp_path_factory) -> dict[str, list[float]]:
    """Per-step train and validation losses of the example on one process (bash re-executes it with
    Python), computed once."""
    if not _reference:
        tb = tmp_path_factory.mktemp("reference") / "postnorm" / "tensorboard"
        run(["bash", EXAMPLE, *_example_flags(tiny_data), "--run-name", "postnorm"],
            MEGAPOST_RUN_DIR=str(tb.parent.parent))
        _reference.update(train=_losses(tb), valid=_losses(tb, "valid/lm_loss"))
        assert len(_reference["train"]) == ITERS and len(_reference["valid"]) == ITERS // 2
    return _reference


def _assert_same_losses(tb: Path, reference: dict[str, list[float]]) -> None:
    assert _losses(tb) == pytest.approx(reference["train"], rel=1e-5)
    assert _losses(tb, "valid/lm_loss") == pytest.approx(reference["valid"], rel=1e-5)


# ----------------------------------------------------------------------------- 1. multi-node


@pytest.mark.integration
def test_two_launchers_form_one_world(tiny_data, tmp_path, example_reference) -> None:
    """(TP,PP,DP)=(2,1,2) over two 'nodes': TP pairs inside a node, the DP all-reduce across them."""
    flags = [*_example_flags(tiny_data), "--tensor-model-parallel-size", "2"]
    jobs = _two_nodes(tmp_path, [EXAMPLE, *flags], MEGAPOST_RUN_DIR=str(tmp_path / "run"))
    _wait(jobs, 300)
    node0, node1 = (job.text() for job in jobs)
    assert [job.proc.returncode for job in jobs] == [0, 0], node0[-3000:] + node1[-3000:]
    for node, log in enumerate((node0, node1)):
        assert f"nnodes=2, num_local_procs=2, node_rank={node}" in log and "dist_world_size=4" in log
    assert "{'localhost': [0, 1], '127.0.0.1': [2, 3]}" in node0  # DeepSpeed's global_rank_mapping
    assert "(TP,PP,DP)=(2,1,2)" in node1  # the logging rank is the last one, global rank 3 on node 1
    runs = [p for p in (tmp_path / "run").iterdir() if p.is_dir() and not p.is_symlink()]  # not `latest`
    assert len(runs) == 1  # rank 0 named the run for both nodes
    _assert_same_losses(runs[0] / "tensorboard", example_reference)


# ----------------------------------------------------------------------------- 2. the example at (2,2,1)


@pytest.mark.integration
@pytest.mark.slow  # the 4-rank TP2xPP2 trainer is in CI through test_parallel_layouts' tp2-pp2
def test_example_at_tp2_pp2(tiny_data, tmp_path, example_reference) -> None:
    out = run(_deepspeed(4, [EXAMPLE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                             "2", *_example_flags(tiny_data), "--run-name", "postnorm"]),
              MEGAPOST_RUN_DIR=str(tmp_path))
    assert "(TP,PP,DP)=(2,2,1)" in out.stdout
    _assert_same_losses(tmp_path / "postnorm" / "tensorboard", example_reference)
    ckpt = tmp_path / "postnorm" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"iter_{ITERS:07d}"
    assert '"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2' in (
        ckpt / f"iter_{ITERS:07d}" / "megapost_meta.json").read_text()


# ----------------------------------------------------------------------------- 3. failures end the job


def _failing_flags(data, **overrides) -> list[str]:
    """Long enough that only a failure ends the job early; a 30 s collective timeout."""
    return _flags(data, **{"--train-iters": 400, "--distributed-timeout-minutes": TIMEOUT_MIN,
                           "--tensor-model-parallel-size": 2, **overrides})


@pytest.mark.integration
def test_rank_that_raises_ends_the_job(tiny_data, tmp_path) -> None:
    """--fail-rank 1:3 (tools/fault_pretrain.py): rank 1 raises before iteration 3; rank 0, blocked in a
    tensor-parallel collective with it, must not outlive it for long."""
    job = Job(_deepspeed(2, [FAULT_PRETRAIN, "--fail-rank", "1:3", *_failing_flags(tiny_data)]),
              tmp_path / "log")
    failed = _wait([job], 240, until="rank 1 fails at iteration 3 on purpose")
    ended = _wait([job], 90)
    text = job.text()
    assert job.proc.returncode != 0, text[-3000:]
    assert "iteration      2/400" in text and "iteration      3/400" not in text
    print(f"job ended {ended - failed:.1f} s after rank 1 raised")
    assert ended - failed < 45, f"job took {ended - failed:.1f} s to end after the failure"


@pytest.mark.integration
def test_killed_rank_ends_the_job(tiny_data, tmp_path) -> None:
    """SIGKILL rank 0 (it also hosts the rendezvous store) after iteration 2."""
    job = Job(_deepspeed(2, ["--module", "megapost.pretrain", *_failing_flags(tiny_data)]), tmp_path / "log")
    _wait([job], 240, until="iteration      2/400")
    os.kill(job.rank_pid(0), signal.SIGKILL)
    killed = time.monotonic()
    ended = _wait([job], 90)
    assert job.proc.returncode != 0, job.text()[-3000:]
    print(f"job ended {ended - killed:.1f} s after rank 0 was killed")
    assert ended - killed < 45, f"job took {ended - killed:.1f} s to end after the kill"


@pytest.mark.slow
def test_failure_on_one_node_ends_the_other(tiny_data, tmp_path) -> None:
    """No launcher spans both nodes: node 0's ranks must notice that rank 3 (node 1) died by themselves."""
    jobs = _two_nodes(tmp_path, [FAULT_PRETRAIN, "--fail-rank", "3:3", *_failing_flags(tiny_data)])
    failed = _wait(jobs, 300, until="rank 3 fails at iteration 3 on purpose")
    ended = _wait(jobs, 120)
    assert [job.proc.returncode != 0 for job in jobs] == [True, True]
    print(f"both nodes ended {ended - failed:.1f} s after rank 3 raised")
    assert ended - failed < 60, f"the job took {ended - failed:.1f} s to end after the failure"


@pytest.mark.slow
def test_hung_rank_times_out(tiny_data, tmp_path) -> None:
    """SIGSTOP rank 1: no connection closes, so only the 30 s collective timeout ends rank 0 (before the
    fix in distributed.default_group_timeout the tensor-parallel group waited torch's 30 min). The
    launcher then SIGTERMs the stopped rank, which cannot act on it, and SIGKILLs it 30 s later."""
    job = Job(_deepspeed(2, ["--module", "megapost.pretrain", *_failing_flags(tiny_data)]), tmp_path / "log")
    try:
        _wait([job], 240, until="iteration      2/400")
        os.kill(job.rank_pid(1), signal.SIGSTOP)
        stopped = time.monotonic()
        ended = _wait([job], 240)
    finally:
        job.kill()
    text = job.text()
    assert job.proc.returncode != 0, text[-3000:]
    # the survivor's one line names the collective, its group and the rank that stopped (hang_report)
    lines = [ln for ln in text.splitlines() if "error: rank 0: " in ln]
    assert len(lines) == 1, text[-3000:]
    assert re.search(r"error: rank 0: \w+ over ranks \[0, 1\] \(called from .*\) timed out after 0.5 min "
                     r"\(--distributed-timeout-minutes\) at iteration \d+; rank\(s\) 1 \(last heartbeat "
                     r"at iteration \d+\) stopped answering: stopped, killed or frozen$", lines[0]), lines[0]
    print(lines[0])
    print(f"job ended {ended - stopped:.1f} s after rank 1 stopped")
    assert 30 <= ended - stopped < 120, f"job took {ended - stopped:.1f} s to end after the hang"


@pytest.mark.integration
@pytest.mark.slow
def test_node_that_never_joins_times_out(tiny_data, tmp_path) -> None:
    """Only node 0 of the two-node hostfile starts: the rendezvous gives up after the timeout."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    cmd = ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "--module", "megapost.pretrain",
           *_failing_flags(tiny_data)]
    start = time.monotonic()
    proc = run(cmd, check=False, timeout=180)
    elapsed = time.monotonic() - start
    print(f"node 0 alone ended after {elapsed:.1f} s")
    assert proc.returncode != 0 and "2/4 clients joined" in proc.stdout + proc.stderr
    assert elapsed < 120


@pytest.mark.integration
def test_new_groups_take_the_distributed_timeout(tmp_path) -> None:
    """Groups DeepSpeed creates (new_group without a timeout) get --distributed-timeout-minutes."""
    code = """
import argparse, torch, deepspeed.comm as ds_dist
from megapost.runtime.distributed import init_distributed
args = argparse.Namespace(local_rank=0, distributed_backend="gloo", distributed_timeout_minutes=0.25)
init_distributed(args.local_rank, args.distributed_backend, args.distributed_timeout_minutes)
cpu = torch.device("cpu")
print("timeouts", ds_dist.new_group([0])._get_backend(cpu).options._timeout.total_seconds(),
      torch.distributed.group.WORLD._get_backend(cpu).options._timeout.total_seconds())
"""
    out = run([sys.executable, "-c", code])
    assert "timeouts 15.0 15.0" in out.stdout


# ----------------------------------------------------------------------------- 4. checkpoints at a layout


def _layout(tp: int, pp: int) -> dict[str, int]:
    return {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp}


def _refused(data, tmp: Path, ckpt: Path, nprocs: int, tp: int, pp: int) -> tuple[str, float]:
    """Load ``ckpt`` at (tp, pp): must fail with the one-line layout error before DeepSpeed reads it."""
    flags = _flags(data, **{"--train-iters": 2 * ITERS, "--load": ckpt,
                            "--tensorboard-dir": tmp / f"refused-{tp}-{pp}", **_layout(tp, pp)})
    start = time.monotonic()
    proc = pretrain(flags, nprocs=nprocs, check=False, timeout=120)
    elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    errors = [line for line in text.splitlines() if LAYOUT_ERROR in line]
    assert errors and all(line.startswith("error: --load ") for line in errors), text[-3000:]
    assert "Traceback" not in text and "Loading" not in text and "loaded" not in text, text[-3000:]
    assert not (tmp / f"refused-{tp}-{pp}").exists()  # stopped before the model and TensorBoard
    return text, elapsed


@pytest.mark.integration
@pytest.mark.slow  # checkpoints without layout-free state: only older megapost wrote them
def test_checkpoint_of_another_layout_is_refused(tiny_data, tmp_path) -> None:
    """A real checkpoint at (2,1,1) without its layout-free state (as older megapost wrote them) loaded
    at (1,2,1) and at (1,1,1)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    pretrain(_flags(tiny_data, **{"--train-iters": 2, "--save": ckpt, **_layout(2, 1)}), nprocs=2)
    shutil.rmtree(ckpt / "iter_0000002" / "layout_free")
    text, elapsed = _refused(tiny_data, tmp_path, ckpt, 2, 1, 2)
    assert "was saved with --tensor-model-parallel-size 2 but this run uses 1" in text
    assert elapsed < 45
    text, elapsed = _refused(tiny_data, tmp_path, ckpt, 1, 1, 1)
    assert text.count(LAYOUT_ERROR) == 1 and elapsed < 30


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 1), (1, 1, 2), (1, 2, 1)])
def test_resume_at_layout_continues_exactly(tiny_data, tmp_path, tp: int, pp: int, dp: int) -> None:
    """2N steps in one run == N steps, save, resume, N more, at the same layout (ZeRO-1, fp32)."""
    n, world = ITERS // 2, tp * pp * dp
    layout = _layout(tp, pp)
    full = _flags(tiny_data, **{"--tensorboard-dir": tmp_path / "full", **layout})
    pretrain(full, nprocs=world)
    first = _flags(tiny_data, **{"--train-iters": n, "--lr-decay-iters": ITERS, "--save": tmp_path / "ckpt",
                                 "--tensorboard-dir": tmp_path / "first", **layout})
    pretrain(first, nprocs=world)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_{n:07d}"
    second = _flags(tiny_data, **{"--load": tmp_path / "ckpt", "--tensorboard-dir": tmp_path / "second",
                                  **layout})
    out = pretrain(second, nprocs=world)
    assert f"resumed from {tmp_path / 'ckpt'} at iteration {n}" in out.stdout
    resumed = _losses(tmp_path / "first") + _losses(tmp_path / "second")
    assert len(resumed) == ITERS and resumed == _losses(tmp_path / "full")
