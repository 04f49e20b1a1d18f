"""Signals and exits: ranks die with their launcher, Ctrl-C ends in one line, preemption saves and exits 0.

* Under a launcher every rank asks Linux for SIGTERM when its parent (DeepSpeed's ``launch.py``) dies
  (``prctl(PR_SET_PDEATHSIG)``), and a watchdog thread sends itself SIGINT when the ``deepspeed``
  runner above ``launch.py`` goes away (single-node runs: the runner forwards no signal).
* Without ``--exit-signal-handler``, SIGINT stops the run at once; global rank 0 prints
  ``interrupted at iteration N; last complete checkpoint: ...; resume with: ...`` (exit 130).
  SIGTERM exits at once (status 143) — unless it follows a SIGINT: a terminal's Ctrl-C reaches the
  launcher too, which SIGTERMs the ranks right away, and Python runs pending handlers in signal order,
  so the SIGINT's line still gets printed.
* With it, SIGINT and SIGTERM only raise a flag; the trainer saves at the next step boundary and
  exits 0. Ranks agree on the boundary with one all-reduce (MAX) of a 2-int CPU tensor over gloo per
  step (no device sync), done only when ``--exit-signal-handler`` or ``--exit-duration-in-mins`` is set.
* After the corpus build, right before the process group binds it, rank 0 checks that ``MASTER_PORT`` is
  free (one line naming ``--master_port`` and ``make train LAUNCHER=...``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_write_text

PR_SET_PDEATHSIG = 1
DEFAULT_MASTER_PORT = "29500"


class Interrupted(KeyboardInterrupt):
    """SIGINT without --exit-signal-handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Progress:
    """What the one-line interrupt message needs and what a caught signal asks for: one per run, made by
    whoever runs it (``megapost.pretrain``) and owned by its Trainer; the build fills it in as the run
    takes shape. Its methods are the signal handlers (``install``)."""

    save: str | None = None  # --save as resolved
    run_name: str | None = None  # --run-name as resolved (None: no run directory)
    runs_dir: str | None = None  # --runs-dir as resolved
    state: Any = None  # the trainer's TrainState (``.iteration``)
    # megapost.checkpoint.folder.last_complete (the one reader of 'latest'), set by the trainer's build
    checkpoint_of: Callable[[str], str | None] | None = None
    requested: int = 0  # signal number caught while --exit-signal-handler defers it
    deferring: bool = False
    interrupted: bool = False

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.deferring:  # --exit-signal-handler: the trainer saves at the next step boundary
            self.requested = self.requested or signum
            return
        if self.interrupted:
            return
        self.interrupted = True
        # the launcher's follow-up SIGTERM while we print: a Python no-op, not SIG_IGN — a SIGTERM already
        # pending would then raise "OSError: Signal 15 ignored due to race condition" mid-unwind
        signal.signal(signal.SIGTERM, _ignore)
        raise Interrupted(signum)

    def on_sigterm(self, signum: int, _frame: Any) -> None:
        """Without --exit-signal-handler: exit now, as SIGTERM's default would, unless a SIGINT is already
        being handled (then the launcher's follow-up SIGTERM must not cut its line off)."""
        if not self.interrupted:
            os._exit(128 + signum)

    def install(self, defer: bool = False) -> None:
        """This process's SIGINT/SIGTERM handlers: SIGINT raises :class:`Interrupted` once; with ``defer``
        (--exit-signal-handler) SIGINT and SIGTERM only set ``requested``.

        Without ``defer`` SIGTERM exits at once (``on_sigterm``): the launcher stops surviving ranks with
        it when one rank fails. A rank blocked in a collective runs it when the collective returns (a dead
        peer ends it with an error), or the launcher's SIGKILL follows.
        """
        self.deferring = defer
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.on_signal)
            signal.signal(signal.SIGTERM, self.on_signal if defer else self.on_sigterm)

    def last_checkpoint(self) -> str:
        """``<save>/<tag>`` a resume would load (``checkpoint_of``), else ``none``."""
        if not self.save:
            return "none (no --save)"
        found = self.checkpoint_of(self.save) if self.checkpoint_of is not None else None
        return found or "none"

    def interrupted_line(self) -> str:
        iteration = self.state.iteration if self.state is not None else 0
        last, command = self.last_checkpoint(), resume_command(self.save, self.run_name, self.runs_dir)
        if last.startswith("none"):  # nothing to resume: the same command starts the run over
            return (f"interrupted at iteration {iteration}; last complete checkpoint: {last}; nothing saved "
                    f"(Ctrl-C saves only with --exit-signal-handler); start over with: {command}")
        return (f"interrupted at iteration {iteration}; last complete checkpoint: {last}; "
                f"resume with: {command}")




# ---- launcher ancestry -----------------------------------------------------------------------------
def _ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def die_with_launcher() -> None:
    """Under a launcher (LOCAL_RANK set) on Linux: this rank gets SIGTERM when its launcher dies."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if "deepspeed.launcher.launch" not in _cmdline(parent):
        return
    runner = _ppid_of(parent)  # the `deepspeed` runner (or a pdsh shell on multi-node)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent or _ppid_of(parent) != runner:
                os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C reached this rank: the one line
                return

    threading.Thread(target=watch, name="megapost-launcher-watchdog", daemon=True).start()


# ---- signals ------------------------------------------------------------------------------------------
def _ignore(_signum: int, _frame: Any) -> None:
    """A handled-and-dropped signal."""


def _port_marker(port: str) -> str:
    """A name the ranks of one launch.py share (its pid and start time): rank 0's verdict on the port."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return os.path.join(tempfile.gettempdir(), f".megapost-port-{port}-{ppid}-{started}")


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is fine
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_master_port(wait_s: float = 120.0) -> None:
    """Under DeepSpeed's launcher: global rank 0 (which binds MASTER_PORT when torch.distributed
    starts) checks that the port is free and fails now, in one line, before any data is built; the
    other ranks of its node wait for that verdict (a marker file) so none of them starts building."""
    env = os.environ
    port = env.get("MASTER_PORT")
    if (not port or "LOCAL_SIZE" not in env or "RANK" not in env
            or "TORCHELASTIC_RUN_ID" in env):  # torchrun's agent holds the port itself
        return
    rank, marker = int(env["RANK"]), _port_marker(port)
    if rank == 0:
        busy = _port_in_use(int(port))
        atomic_write_text(marker, "busy" if busy else "ok")
        if busy:
            with socket.socket() as free:
                free.bind(("", 0))
                suggestion = free.getsockname()[1]
            raise ConfigError(
                f"port {port} (MASTER_PORT) is already in use on this node, another job holds it; launch "
                f"with another, e.g. `deepspeed --master_port {suggestion} ...` (make train "
                f"LAUNCHER=\"--master_port {suggestion}\")"
            )
    elif rank < int(env["LOCAL_SIZE"]):  # rank 0's node
        deadline = time.time() + wait_s
        while not os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(OSError), open(marker) as f:
            if f.read() == "busy":
                raise SystemExit(1)  # rank 0 says why


def forget_port_check() -> None:
    """Rank 0, once every rank has joined the process group: remove the verdict file."""
    port = os.environ.get("MASTER_PORT")
    if port and os.environ.get("RANK") == "0":
        with contextlib.suppress(OSError):
            os.unlink(_port_marker(port))


def at_rank_start(progress: Progress) -> None:
    """Everything a rank does first, before any heavy work: ``progress``'s signal handlers, and (once per
    process: it starts a thread) dying with the launcher."""
    progress.install()
    if not getattr(die_with_launcher, "done", False):
        die_with_launcher.done = True  # type: ignore[attr-defined]
        die_with_launcher()


# ---- the one line ---------------------------------------------------------------------------------------
def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with every ``flag`` (``--f v`` or ``--f=v``) replaced by one ``flag value`` at the end."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return [*out, flag, value]


def resume_command(save: str | None = None, run_name: str | None = None,
                   runs_dir: str | None = None) -> str:
    """The command that continues this run: the launch as typed, with --run-name (a run under
    ``runs_dir``) or --load ``save`` added."""
    user = [a for a in sys.argv[1:] if not a.startswith(("--local_rank", "--local-rank"))]
    if runs_dir and run_name:
        user = _with_flag(user, "--run-name", run_name)
    elif save:
        user = _with_flag(user, "--load", save)
    script = sys.argv[0]
    module = script.endswith(os.path.join("megapost", "pretrain.py"))
    env = os.environ
    if "LOCAL_SIZE" in env:  # DeepSpeed's launcher
        local = int(env["LOCAL_SIZE"])
        nodes = max(1, int(env.get("WORLD_SIZE", local)) // local)
        head = ["deepspeed"] + (["--num_nodes", str(nodes)] if nodes > 1 else []) + ["--num_gpus", str(local)]
        if env.get("MASTER_PORT", DEFAULT_MASTER_PORT) != DEFAULT_MASTER_PORT:
            head += ["--master_port", env["MASTER_PORT"]]
        head += ["--module", "megapost.pretrain"] if module else [script]
    elif module:
        head = ["python", "-m", "megapost.pretrain"]
    else:
        head = ["bash" if script.endswith(".sh") else "python", script]
    return shlex.join(head + user)


def run_guarded(fn: Callable[[], Any], progress: Progress | None = None) -> Any:
    """Run ``fn``; an interrupt ends it with the one line (of ``progress``: the run's, filled in by its
    build), printed by global rank 0 only."""
    progress = progress or Progress()
    at_rank_start(progress)
    try:
        return fn()
    except Interrupted as e:
        if os.environ.get("RANK", "0") == "0":  # one write: print's separate newline could interleave
            sys.stderr.flush()                   # with the launcher's log lines
            os.write(sys.stderr.fileno(), (progress.interrupted_line() + "\n").encode())
        raise SystemExit(128 + e.signum) from None


# ---- planned exits ---------------------------------------------------------------------------------------
class ExitConditions:
    """--exit-signal-handler / --exit-interval / --exit-duration-in-mins, decided the same on every rank."""

    def __init__(self, interval: int, minutes: float, signals: bool, progress: Progress) -> None:
        """--exit-interval, --exit-duration-in-mins, --exit-signal-handler; ``progress``: the run's (its
        signal handlers defer to the next step boundary under --exit-signal-handler)."""
        self.interval, self.minutes, self.signals, self.progress = interval, minutes, signals, progress
        self.start = time.time()
        self.group: Any = None
        self.reduce = bool(self.signals or self.minutes > 0) and dist.is_initialized() \
            and dist.get_world_size() > 1
        if self.reduce and dist.get_backend() != "gloo":  # a CPU side channel: no device sync per step
            try:
                self.group = dist.new_group(backend="gloo")
            except RuntimeError as e:  # gloo picks the hostname's interface; it may not route
                raise RuntimeError(f"--exit-signal-handler/--exit-duration-in-mins: the CPU side group "
                                   f"(gloo) did not start ({e}); set GLOO_SOCKET_IFNAME to a routable "
                                   "interface (as NCCL_SOCKET_IFNAME)") from e
        if self.signals:
            progress.install(defer=True)

    def check(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (None: go on)."""
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        if not (self.signals or self.minutes > 0):
            return None
        flags = torch.tensor([self.progress.requested,
                              int(self.minutes > 0 and time.time() - self.start >= 60 * self.minutes)])
        if self.reduce:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if flags[0]:
            return f"{signal.Signals(int(flags[0])).name} (--exit-signal-handler)"
        if flags[1]:
            return f"--exit-duration-in-mins {self.minutes:g}"
        return None
