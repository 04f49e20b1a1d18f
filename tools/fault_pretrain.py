"""``megapost.pretrain`` with faults injected: the harness side of ``megapost.utils.faults`` (the tests'
and the soak's, ``tools/soak.py``; production runs never build one).

    python tools/fault_pretrain.py [FAULTS] [megapost flags]
    deepspeed --num_gpus N tools/fault_pretrain.py [FAULTS] [megapost flags]

FAULTS (each optional; RANK is the global rank, ITER a 1-based iteration):
  --fail-rank RANK:ITER       that rank raises a RuntimeError just before it runs ITER (a job whose rank
                              dies must fail as a whole, within --distributed-timeout-minutes)
  --kill-point PHASE:HIT:RANK that rank sends itself SIGKILL the HIT-th time it passes PHASE (comma-
                              separated for several; phases: ``PHASES``)
  --enospc RANK               that rank's first background checkpoint write fails as on a full disk
  --slow-save ITER:SECONDS    every rank's save of ITER sleeps SECONDS with its first file half written
  --slow-snapshot ITER:SECONDS  the async snapshot of ITER sleeps SECONDS with its first tensor copied
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
from typing import Any

import torch

from megapost.utils.faults import FaultInjector

PHASES = ("index_build", "forward", "backward", "optimizer_step", "sync_save", "async_write", "eval")


def parse_kill_points(spec: str, rank: int) -> dict[str, int]:
    """``PHASE:HIT:RANK`` (comma-separated for several) -> {phase: hit} for ``rank``."""
    plan: dict[str, int] = {}
    for item in filter(None, spec.split(",")):
        phase, hit, who = item.split(":")
        if phase not in PHASES:
            raise ValueError(f"--kill-point: unknown phase {phase!r} (one of {', '.join(PHASES)})")
        if int(who) == rank:
            plan[phase] = int(hit)
    return plan


def _pair(spec: str | None) -> tuple[int, float] | None:
    if not spec:
        return None
    a, b = spec.split(":")
    return int(a), float(b)


class Faults(FaultInjector):
    """The faults of the command line, for global rank ``rank``."""

    def __init__(self, args: argparse.Namespace, rank: int, sleep: Any = time.sleep) -> None:
        self.rank, self.sleep = rank, sleep
        self.fail = tuple(int(x) for x in args.fail_rank.split(":")) if args.fail_rank else None
        self.plan = parse_kill_points(args.kill_point or "", rank)
        self.seen = dict.fromkeys(self.plan, 0)
        self.enospc = args.enospc is not None and args.enospc == rank
        self.slow_save, self.slow_snapshot = _pair(args.slow_save), _pair(args.slow_snapshot)

    def before_step(self, rank: int, iteration: int) -> None:
        if self.fail == (rank, iteration):
            raise RuntimeError(f"injected fault: rank {rank} fails at iteration {iteration} on purpose")

    def point(self, phase: str) -> None:
        """Count a pass through ``phase``; SIGKILL this process at the planned pass."""
        if phase not in self.plan:
            return
        self.seen[phase] += 1
        if self.seen[phase] == self.plan[phase]:
            sys.stderr.write(f"megapost kill point: SIGKILL rank {self.rank} (pid {os.getpid()}) in {phase} "
                             f"(pass {self.seen[phase]})\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def save_file_half_written(self, iteration: int, background: bool) -> None:
        if self.enospc and background:
            self.enospc = False
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (fault injected: --enospc)")
        self.point("async_write" if background else "sync_save")
        if self.slow_save is not None and self.slow_save[0] == iteration:
            self.sleep(self.slow_save[1])

    def snapshot_half_taken(self, iteration: int) -> None:
        if self.slow_snapshot is not None and self.slow_snapshot[0] == iteration:
            self.sleep(self.slow_snapshot[1])

    def install(self, module: Any, optimizer: Any) -> None:
        """The forward, backward and optimizer-step points on ``module`` (its middle block) and the torch
        ``optimizer``, only when one of them is planned."""
        blocks = [m for name, m in module.named_modules() if name.split(".")[-1].isdigit()]
        middle = blocks[len(blocks) // 2] if blocks else module
        if "forward" in self.plan:
            middle.register_forward_hook(
                lambda *_: self.point("forward") if torch.is_grad_enabled() else None)
        if "backward" in self.plan:
            param = next(p for p in middle.parameters() if p.requires_grad)
            param.register_hook(lambda grad: self.point("backward"))
        if "optimizer_step" in self.plan:
            optimizer.register_step_post_hook(lambda *_: self.point("optimizer_step"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--fail-rank", "--kill-point", "--slow-save", "--slow-snapshot"):
        p.add_argument(flag)
    p.add_argument("--enospc", type=int)
    return p


def split_argv(argv: list[str], rank: int | None = None) -> tuple[Faults, list[str]]:
    """(the faults of ``argv``'s FAULTS flags for this rank, the other flags)."""
    args, rest = parser().parse_known_args(argv)
    return Faults(args, int(os.environ.get("RANK", "0")) if rank is None else rank), rest


if __name__ == "__main__":
    from megapost.pretrain import main

    faults, flags = split_argv(sys.argv[1:])
    main(flags, faults=faults)
