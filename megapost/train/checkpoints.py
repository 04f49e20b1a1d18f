"""The checkpoint manager: save and load through megapost.checkpoint (with the plugins' states and the
finite guard), continuing a resumed run's logs, and in-memory snapshots for rollback."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch

from megapost.checkpoint import codec, resume
from megapost.checkpoint.folder import ASIDE, CheckpointFolder
from megapost.checkpoint.layout import RunLayout
from megapost.checkpoint.saver import AsyncSaver, barrier
from megapost.config.resolved import Config
from megapost.engine import Engine
from megapost.metrics.monitor import Monitor
from megapost.parallel.state import ParallelState
from megapost.train.logger import host_norms
from megapost.train.plugin_host import PluginHost
from megapost.utils.faults import NO_FAULTS, FaultInjector

SKIPS_KEY = "megapost.skips"  # the skip counts, beside the plugins' states in a tag


def to_host(tree: Any) -> Any:
    """A deep copy with every tensor cloned to CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return copy.deepcopy(tree)


class CheckpointManager:
    """Saves/loads ``engine`` (through the Engine protocol only) and the ``state`` (a TrainState) of this
    rank, as ``config`` says (its checkpoint section; the model and layout a checkpoint records); owns
    this rank's :class:`AsyncSaver`."""

    def __init__(self, config: Config, engine: Engine, pstate: ParallelState, state: Any,
                 host: PluginHost, monitor: Monitor, device: torch.device, logger: Any = None,
                 faults: FaultInjector = NO_FAULTS) -> None:
        """``logger``: the TrainLogger whose skip counts each tag keeps (None: none kept); ``faults``: a
        test harness's, passed to the saver."""
        self.config, self.ckpt, self.engine = config, config.checkpoint, engine
        self.pstate, self.state = pstate, state
        self.host, self.monitor, self.device, self.logger = host, monitor, device, logger
        self.saver = AsyncSaver(faults)
        self._reserved = False

    def _states(self) -> dict[str, Any]:
        """The plugins' states and, under its own key, the skip counts."""
        states = self.host.states()
        if self.logger is not None:
            states[SKIPS_KEY] = self.logger.skip_state()
        return states

    def save(self) -> None:
        st = self.state
        norms = host_norms([norm for _, _, norm, _ in st.losses])  # a non-finite norm: a skipped step
        pending = [(f"{what} of step {it}", t)
                   for (it, loss, norm, _), n in zip(st.losses, norms, strict=True)
                   if n is None or math.isfinite(n)
                   for what, t in (("loss", loss), ("grad norm", norm))]
        tag = self.saver.save(self.engine, self.config, st.iteration, st.consumed_samples, self._states(),
                         self.pstate, checked=pending, device=self.device)
        done = "saving checkpoint (in the background)" if self.ckpt.async_save else "saved checkpoint"
        self.monitor.line(f" {done} {self.ckpt.save}/{tag}")

    def start(self) -> None:
        """At start-up, every rank: ``--save`` must be seen by every rank (refused in one line if not);
        its tags beyond the iteration training starts at (a resume from an older tag, ``--finetune``)
        are moved to ``set-aside/`` by rank 0, with a note; the tag just loaded stays."""
        save = self.ckpt.save
        if not save:
            return
        self.saver.check_shared(save, self.pstate.global_rank)
        folder, spare = CheckpointFolder(save), None
        if self.ckpt.load and os.path.abspath(self.ckpt.load) == os.path.abspath(save):
            spare = folder.resolve(step=self.ckpt.ckpt_step).tag
        beyond = folder.beyond(self.state.iteration, spare)
        barrier()  # every rank has looked before rank 0 moves anything
        if beyond and self.pstate.global_rank == 0:
            folder.set_aside(self.state.iteration, spare)
        if beyond:
            self.monitor.line(f" megapost: --save {save}: {len(beyond)} tags beyond iteration "
                              f"{self.state.iteration} (not on this run's timeline) moved to "
                              f"{os.path.join(save, ASIDE)}/: {', '.join(beyond)}")

    def poll(self) -> None:
        """At each step boundary: a background save done everywhere is published, a failed one raises
        on every rank (nothing, and no collective, when none is pending)."""
        self.saver.poll()

    def before_state_changes(self) -> None:
        """Before the optimizer step, a rollback or a load: a background save's snapshot is taken.
        Under --async-save, before the second step (the moments exist), the host buffer is allocated."""
        self.saver.before_state_changes()
        if self.ckpt.async_save and not self._reserved and self.engine.counters()["global_steps"] >= 1:
            self._reserved = True
            self.saver.reserve_host(self.engine, self.config, self._states(), self.pstate)

    def wait(self, raise_errors: bool = True) -> None:
        """Until this rank's background (--async-save) write is complete."""
        self.saver.wait_pending(raise_errors)

    def continue_logs(self, iteration: int, consumed: int) -> None:
        """Drop what earlier attempts logged past ``iteration`` (-1: everything) in this run's
        TensorBoard directory and the plugins' files, so steps never repeat or go backward."""
        self.host.on_resume(iteration)
        self.monitor.resume(iteration, consumed * self.config.model.seq_length)

    def load(self) -> None:
        self.saver.before_state_changes()
        it, consumed, states = resume.load(self.engine, self.ckpt, RunLayout.of(self.config), self.pstate)
        self.state.iteration, self.state.consumed_samples = it, consumed
        skips = states.pop(SKIPS_KEY, {})
        if self.logger is not None:
            self.logger.load_skip_state(skips, it)
        self.host.load_states(states)
        self.continue_logs(it, consumed)
        self.monitor.line(f" resumed from {self.ckpt.load} at iteration {it} ({consumed} samples)")

    def snapshot(self) -> dict[str, Any]:
        """This rank's state to continue exactly from here (ZeRO-0 fp32: module and optimizer state_dict
        copied to host memory), the lr schedule, RNG and data position."""
        snap = self.engine.state_dict()
        return {**snap, "module": to_host(snap["module"]), "optimizer": to_host(snap["optimizer"]),
                "rng": codec.rng_state(), "iteration": self.state.iteration,
                "consumed_samples": self.state.consumed_samples}

    def restore(self, snap: dict[str, Any], skip_data: bool = False) -> None:
        """Engine, schedule, RNG and counters back to ``snap``; ``skip_data`` keeps the data position."""
        self.saver.before_state_changes()
        # the optimizer keeps (and updates) the tensors it loads: a copy, so the snapshot stays
        self.engine.load_state_dict({**snap, "optimizer": copy.deepcopy(snap["optimizer"])})
        codec.set_rng_state(snap["rng"])
        self.state.iteration = snap["iteration"]
        if not skip_data:
            self.state.consumed_samples = snap["consumed_samples"]
