"""The checkpoint manager: save and load through megapost.checkpoint (with the plugins' states and the
finite guard), continuing a resumed run's logs, and in-memory snapshots for rollback."""

from __future__ import annotations

import copy
from typing import Any

import torch

from megapost.checkpoint import finite_guard, saver
from megapost.checkpoint import io as checkpoint_io
from megapost.config.resolved import Config
from megapost.metrics.monitor import Monitor
from megapost.parallel.state import ParallelState
from megapost.train.plugin_host import PluginHost


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
    """Saves/loads ``engine`` and the ``state`` (a TrainState) of this rank, as ``config`` says (its
    checkpoint section; the layout and flags a checkpoint records)."""

    def __init__(self, config: Config, engine: Any, pstate: ParallelState, state: Any,
                 host: PluginHost, monitor: Monitor, device: torch.device) -> None:
        self.config, self.ckpt, self.engine = config, config.checkpoint, engine
        self.pstate, self.state = pstate, state
        self.host, self.monitor, self.device = host, monitor, device

    def save(self) -> None:
        st = self.state
        pending = [t for _, loss, norm, _ in st.losses for t in (loss, norm)]
        finite_guard.refuse_non_finite(self.engine.module.parameters(), pending, st.iteration,
                                       self.ckpt.save, self.device)
        tag = saver.save(self.engine, self.config, st.iteration, st.consumed_samples, self.host.states(),
                         self.pstate)
        done = "saving checkpoint (in the background)" if self.ckpt.async_save else "saved checkpoint"
        self.monitor.line(f" {done} {self.ckpt.save}/{tag}")

    def before_state_changes(self) -> None:
        """Before the optimizer step, a rollback or a load: a background save's snapshot is taken.
        Under --async-save, before the second step (the moments exist), the host buffer is allocated."""
        saver.before_state_changes()
        if self.ckpt.async_save and self.engine.global_steps >= 1 and not getattr(self, "_reserved", False):
            self._reserved = True
            saver.reserve_host(self.engine, self.config, self.host.states(), self.pstate)

    def wait(self, raise_errors: bool = True) -> None:
        """Until this rank's background (--async-save) write is complete."""
        saver.wait_pending(raise_errors)

    def continue_logs(self, iteration: int, consumed: int) -> None:
        """Drop what earlier attempts logged past ``iteration`` (-1: everything) in this run's
        TensorBoard directory and the plugins' files, so steps never repeat or go backward."""
        self.host.on_resume(iteration)
        self.monitor.resume(iteration, consumed * self.config.data.seq_length)

    def load(self) -> None:
        saver.before_state_changes()
        run = checkpoint_io.RunLayout.of(self.config.flags)
        it, consumed, states = checkpoint_io.load(self.engine, self.ckpt, run, self.pstate)
        self.state.iteration, self.state.consumed_samples = it, consumed
        self.host.load_states(states)
        self.continue_logs(it, consumed)
        self.monitor.line(f" resumed from {self.ckpt.load} at iteration {it} ({consumed} samples)")

    def snapshot(self) -> dict[str, Any]:
        """This rank's state to continue exactly from here (ZeRO-0 fp32: module and optimizer state_dict
        copied to host memory), the lr schedule, RNG and data position."""
        eng = self.engine
        return {"module": to_host(eng.module.state_dict()),
                "optimizer": to_host(eng.optimizer.state_dict()),
                "scheduler": eng.lr_scheduler.state_dict(), "rng": checkpoint_io.rng_state(),
                "iteration": self.state.iteration, "consumed_samples": self.state.consumed_samples,
                "global_steps": eng.global_steps, "global_samples": eng.global_samples}

    def restore(self, snap: dict[str, Any], skip_data: bool = False) -> None:
        """Engine, schedule, RNG and counters back to ``snap``; ``skip_data`` keeps the data position."""
        eng = self.engine
        saver.before_state_changes()
        eng.module.load_state_dict(snap["module"])
        eng.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))  # it keeps (and updates) the tensors
        eng.lr_scheduler.load_state_dict(snap["scheduler"])
        checkpoint_io.set_rng_state(snap["rng"])
        eng.global_steps, eng.global_samples = snap["global_steps"], snap["global_samples"]
        self.state.iteration = snap["iteration"]
        if not skip_data:
            self.state.consumed_samples = snap["consumed_samples"]
