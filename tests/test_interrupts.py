"""Interrupts and preemption through DeepSpeed's real launcher: one line, no orphans, save-and-exit."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import psutil
import pytest
from dist_utils import free_port
from launch_utils import REPO, child_env, pretrain, tiny_model_flags

INTERRUPTED = re.compile(
    r"^interrupted at iteration (\d+); last complete checkpoint: (\S+);"
    r"(?: nothing saved \([^)]*\);)? (?:resume|start over) with: (.+)$", re.M)


class Launch:
    """``deepspeed --num_gpus 2 ...`` in its own session, its output collected by a thread."""

    def __init__(self, args: list[str], **env: str) -> None:
        command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), *args]
        self.proc = subprocess.Popen(command, cwd=REPO, env=child_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.seen:
                self.lines.append(line)
                self.seen.notify_all()

    def wait_for(self, pattern: str, timeout: float = 600) -> None:
        with self.seen:
            ok = self.seen.wait_for(lambda: any(pattern in line for line in self.lines) or
                                    self.proc.poll() is not None, timeout)
        assert ok and any(pattern in line for line in self.lines), self.output

    def ranks(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "--local_rank" in " ".join(p.cmdline())]

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        threading.Event().wait(0.5)  # let the reader drain
        return rc

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _flags(data, tmp_path: Path, **kw) -> list[str]:
    return ["--module", "megapost.pretrain", *tiny_model_flags(
        data, **{"--train-iters": 100000, "--runs-dir": tmp_path, "--run-name": "r", **kw})]


@pytest.mark.integration
def test_sigterm_with_exit_signal_handler_saves_at_a_step_and_exits_0(tiny_data, tmp_path) -> None:
    run = Launch(_flags(tiny_data, tmp_path, **{"--exit-signal-handler": True}))
    run.wait_for("iteration      2/")
    for rank in run.ranks():  # what a cluster's preemption does: SIGTERM to every rank
        rank.send_signal(signal.SIGTERM)
    assert run.finish() == 0, run.output
    done = re.search(r"exiting at iteration (\d+) \(SIGTERM \(--exit-signal-handler\)\); checkpoint: (\S+);",
                     run.output)
    assert done, run.output
    step, ckpt = int(done.group(1)), tmp_path / "r" / "checkpoints"
    assert done.group(2) == str(ckpt / f"iter_{step:07d}")
    assert (ckpt / "latest").read_text().strip() == f"iter_{step:07d}"
    resumed = pretrain(tiny_model_flags(tiny_data, **{"--load": ckpt, "--train-iters": step + 1}))
    assert f"at iteration {step}" in resumed.stdout and f"iteration {step + 1:6d}/" in resumed.stdout


@pytest.mark.integration
def test_ctrl_c_ends_in_one_line(tiny_data, tmp_path) -> None:
    """SIGINT to the whole foreground group (a terminal's Ctrl-C): one megapost line, from one rank."""
    run = Launch(_flags(tiny_data, tmp_path, **{"--save-interval": 2}))
    run.wait_for("saved checkpoint")
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.finish() != 0
    found = INTERRUPTED.findall(run.output)
    assert len(found) == 1, run.output
    step, last, command = found[0]
    assert int(step) >= 2 and re.fullmatch(rf"{re.escape(str(tmp_path))}/r/checkpoints/iter_\d{{7}}", last)
    assert command.startswith("deepspeed --num_gpus 2 --master_port") and command.endswith("--run-name r")
    frames = re.findall(r'File "([^"]+)"', run.output)  # only DeepSpeed's runner may print a traceback
    assert all(f.endswith(("deepspeed/launcher/runner.py", "subprocess.py", "bin/deepspeed")) for f in frames)


@pytest.mark.integration
def test_ranks_die_with_the_runner(tiny_data, tmp_path) -> None:
    """SIGINT to the `deepspeed` runner alone used to leave launch.py and the ranks training."""
    run = Launch(_flags(tiny_data, tmp_path))
    run.wait_for("iteration      2/")
    tree = psutil.Process(run.proc.pid).children(recursive=True)
    assert len(tree) >= 3  # launch.py and two ranks
    os.kill(run.proc.pid, signal.SIGINT)
    run.finish()
    _, alive = psutil.wait_procs(tree, timeout=120)
    assert not alive, [p.cmdline() for p in alive]
    assert len(INTERRUPTED.findall(run.output)) == 1, run.output


@pytest.mark.integration
def test_busy_master_port_fails_in_one_line(tiny_data, tmp_path) -> None:
    """The port check runs right before the process group forms (after any corpus build: a port taken
    during the build is tests/test_first_hour.py's slow race test)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port),
                               "examples/pretrain_postnorm.sh", "--train-iters", "2",
                               "--data-path", str(tiny_data.prefix), "--tokenizer-model",
                               str(tiny_data.tokenizer_model)], cwd=REPO, timeout=600,
                              env=child_env(MEGAPOST_RUN_DIR=str(tmp_path / "runs")),
                              capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "already in use" in line]
    expected = (rf"error: port {port} \(MASTER_PORT\) is already in use on this node, another job holds it; "
                r"launch with another, e.g. `deepspeed --master_port \d+ \.\.\.` "
                r"\(make train LAUNCHER=\"--master_port \d+\"\)")
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), out
    assert "Traceback" not in out


@pytest.mark.integration
@pytest.mark.parametrize("flag", ["--exit-interval",
                                  pytest.param("--exit-duration-in-mins", marks=pytest.mark.slow)])
def test_planned_exits_save_and_exit_0(tiny_data, tmp_path, flag) -> None:
    value = "3" if flag == "--exit-interval" else "0.0001"
    out = pretrain(tiny_model_flags(tiny_data, **{"--train-iters": 50, "--save": tmp_path / "ckpt",
                                                  flag: value}))
    step = 3 if flag == "--exit-interval" else 1
    assert f"exiting at iteration {step} ({flag} " in out.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_{step:07d}"
