"""Kill points for the soak (``tools/soak.py``): ``MEGAPOST_KILL_POINT=PHASE:HIT:RANK`` makes global rank
RANK send itself SIGKILL the HIT-th time (from 1, counted in this process) it passes PHASE — a real
SIGKILL of a real rank process, at a chosen place inside the step. Unset (every ordinary run), ``hit`` is
one truth test of a module global and ``install`` adds nothing.

Phases: ``index_build`` (between the document and the sample index of a dataset's index build),
``forward`` (after the middle transformer block's forward), ``backward`` (when the gradient of the
middle block's first parameter is computed), ``optimizer_step`` (after the torch optimizer updated the
fp32 weights, before DeepSpeed copies them to the module or the lr schedule steps), ``sync_save`` /
``async_write`` (a checkpoint file half written, in the training thread / the background writer),
``eval`` (between two evaluation micro-batches).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Any

import torch

ENV = "MEGAPOST_KILL_POINT"
PHASES = ("index_build", "forward", "backward", "optimizer_step", "sync_save", "async_write", "eval")


def _parse(spec: str, rank: int) -> dict[str, int]:
    """``PHASE:HIT:RANK`` (comma-separated for several) -> {phase: hit} for ``rank``."""
    plan: dict[str, int] = {}
    for item in filter(None, spec.split(",")):
        phase, hit, who = item.split(":")
        if phase not in PHASES:
            raise ValueError(f"{ENV}: unknown phase {phase!r} (one of {', '.join(PHASES)})")
        if int(who) == rank:
            plan[phase] = int(hit)
    return plan


_PLAN: dict[str, int] = _parse(os.environ.get(ENV, ""), int(os.environ.get("RANK", "0")))
_SEEN: dict[str, int] = {}
ENOSPC_ENV = "MEGAPOST_FAULT_ENOSPC"
_ENOSPC = os.environ.get(ENOSPC_ENV, "") == os.environ.get("RANK", "0")


def hit(phase: str) -> None:
    """Count a pass through ``phase``; SIGKILL this process at the planned pass (no-op when unplanned).
    Fault injection for a soak that may not mount a small filesystem: ``MEGAPOST_FAULT_ENOSPC=RANK``
    makes that rank's first async write fail as on a full disk."""
    global _ENOSPC
    if _ENOSPC and phase == "async_write":
        _ENOSPC = False
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (fault injected: {ENOSPC_ENV})")
    if not _PLAN or phase not in _PLAN:
        return
    _SEEN[phase] = _SEEN.get(phase, 0) + 1
    if _SEEN[phase] == _PLAN[phase]:
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"megapost kill point: SIGKILL rank {rank} (pid {os.getpid()}) in {phase} "
                         f"(pass {_SEEN[phase]})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def save_phase() -> str:
    """The phase of a checkpoint write on this thread: ``async_write`` off the main thread."""
    return "sync_save" if threading.current_thread() is threading.main_thread() else "async_write"


def install(module: Any, optimizer: Any) -> None:
    """The forward, backward and optimizer-step points on ``module`` (its middle block) and the torch
    ``optimizer``, only when one of them is planned for this rank."""
    if not ({"forward", "backward"} & _PLAN.keys() or "optimizer_step" in _PLAN):
        return
    blocks = [m for name, m in module.named_modules() if name.split(".")[-1].isdigit()]
    middle = blocks[len(blocks) // 2] if blocks else module
    if "forward" in _PLAN:
        middle.register_forward_hook(lambda *_: hit("forward") if torch.is_grad_enabled() else None)
    if "backward" in _PLAN:
        param = next(p for p in middle.parameters() if p.requires_grad)
        param.register_hook(lambda grad: hit("backward"))
    if "optimizer_step" in _PLAN:
        optimizer.register_step_post_hook(lambda *_: hit("optimizer_step"))
