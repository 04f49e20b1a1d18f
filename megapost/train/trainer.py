"""The training loop: micro-batches through the DeepSpeed engine, evaluation, logging, checkpoints.

Debugging aid: ``MEGAPOST_FAIL_RANK=<global rank>:<iteration>`` makes that rank raise a
``RuntimeError`` just before it runs that iteration (1-based), to check that a job whose rank dies
fails as a whole, within ``--distributed-timeout-minutes``, instead of hanging.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megapost.checkpoint import finite_guard
from megapost.checkpoint import io as checkpoint_io
from megapost.metrics.monitor import Monitor
from megapost.metrics.throughput import PeakMemory, Throughput, memory_gb
from megapost.parallel.state import ParallelState
from megapost.plugin_api import Plugin
from megapost.runtime.hang_report import explain, is_collective_error, start_heartbeat
from megapost.runtime.interrupts import ExitConditions, last_checkpoint, resume_command


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: list[tuple[int, torch.Tensor, Any, float]] = field(default_factory=list)
    z_losses: dict[int, torch.Tensor] = field(default_factory=dict)  # --z-loss: the z term per step


def injected_failure() -> tuple[int, int] | None:
    """``(rank, iteration)`` from ``MEGAPOST_FAIL_RANK=<rank>:<iteration>``, or None when unset."""
    spec = os.environ.get("MEGAPOST_FAIL_RANK", "").strip()
    if not spec:
        return None
    try:
        rank, iteration = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"MEGAPOST_FAIL_RANK={spec!r}: expected <global rank>:<iteration>") from None
    return rank, iteration


def _to_host(tree: Any) -> Any:
    """A deep copy with every tensor cloned to CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_host(v) for v in tree)
    return copy.deepcopy(tree)



def _host_norms(norms: list[Any]) -> list[float | None]:
    """Grad norms as floats, device tensors copied to the host in one transfer."""
    on_device = [i for i, n in enumerate(norms) if isinstance(n, torch.Tensor)]
    out: list[Any] = list(norms)
    if on_device:
        host = torch.stack([norms[i].detach().float().reshape(()) for i in on_device]).tolist()
        for i, value in zip(on_device, host, strict=True):
            out[i] = value
    return [None if n is None else float(n) for n in out]

class PluginBatches:
    """Iterator wrapper that shows every micro-batch to the plugins measuring this step."""

    def __init__(self, it: Iterator[dict[str, Any]], pipeline: bool) -> None:
        self.it, self.pipeline = it, pipeline
        self.active: list[Plugin] = []
        self.step = 0

    def __iter__(self) -> PluginBatches:
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        for plugin in self.active:
            plugin.on_micro_batch(self.step, batch)
        if self.pipeline:
            return (batch["tokens"],), (batch["labels"], batch["loss_mask"])
        return batch


class Trainer:
    """Owns the engine and runs ``args.train_iters`` optimizer steps."""

    def __init__(self, args: argparse.Namespace, engine: Any, loss_fn: Any, pstate: ParallelState,
                 train_iter_fn: Any, valid_iter_fn: Any, plugins: list[Plugin], monitor: Monitor,
                 flops_per_token: float, peak_tflops: float, device: torch.device) -> None:
        self.args, self.engine, self.loss_fn, self.pstate = args, engine, loss_fn, pstate
        self.pipeline = args.pipeline_model_parallel_size > 1
        self.train_iter_fn, self.valid_iter_fn = train_iter_fn, valid_iter_fn
        self.plugins, self.monitor, self.device = plugins, monitor, device
        self.state = TrainState()
        self.throughput = Throughput(flops_per_token, pstate.world_size, peak_tflops)
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.batches: PluginBatches | None = None
        self.fail_at = injected_failure()
        self.memory = PeakMemory(device)
        self.memory_report: dict[str, Any] = {}
        self.exits = ExitConditions(args)
        self._peak_warned = False

    # ---- one optimizer step -------------------------------------------------------------
    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.pstate.dp_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.pstate.dp_group)
            value /= self.pstate.dp_size
        return value

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host batch -> device; on CUDA through pinned memory, asynchronously (no host sync)."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _micro_losses(self, batches: Iterator[Any], backward: bool) -> torch.Tensor:
        losses = []
        for _ in range(self.args.grad_accum_steps):
            batch = next(batches)
            tokens, labels, mask = (self._to_device(batch[k]) for k in ("tokens", "labels", "loss_mask"))
            loss = self.loss_fn(self.engine(tokens), labels, mask)
            if backward:
                self.engine.backward(loss)
                self.engine.step()
            losses.append(loss.detach().float())
        return self._dp_mean(torch.stack(losses).mean())

    def _z_term(self) -> torch.Tensor | None:
        """--z-loss: this step's z term averaged over this rank's micro-batches, on the ranks that
        computed the loss (None elsewhere, and without --z-loss); averaged over DP at log time."""
        take = getattr(self.loss_fn, "take_z_terms", None)
        terms = take() if take is not None else []
        return torch.stack(terms).mean() if terms else None

    def train_step(self, step: int) -> torch.Tensor:
        self._z_term()  # drop terms from evaluation passes (no collective)
        active = [p for p in self.plugins if p.wants_step(step)]
        assert self.batches is not None
        self.batches.active, self.batches.step = active, step
        self._active = active
        for plugin in active:
            plugin.on_step_begin(step, self.engine.module)
        if self.pipeline:
            loss = self.engine.train_batch(data_iter=self.batches).detach().float()
        else:
            loss = self._micro_losses(self.batches, backward=True)
        if active:
            loss_value = float(loss)
            for plugin in active:
                plugin.on_step_end(step, loss_value)
        self.batches.active = []
        return loss

    def before_optimizer_step(self) -> None:
        for plugin in getattr(self, "_active", []):
            plugin.before_optimizer_step(self.state.iteration + 1, self.engine)

    # ---- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        it = self.valid_iter_fn()
        if it is None:
            return math.nan
        batches = PluginBatches(it, self.pipeline)
        total = torch.zeros((), device=self.device)
        for _ in range(self.args.eval_iters):
            if self.pipeline:
                # the last stage returns a 0-d loss, the others DeepSpeed's broadcast copy of shape [1]
                loss = self.engine.eval_batch(data_iter=batches).detach().float().reshape(())
                total += self._dp_mean(loss)
            else:
                self.engine.eval()
                total += self._micro_losses(batches, backward=False)
                self.engine.train()
        return float(total) / self.args.eval_iters

    def measure_at_init(self) -> None:
        """Step 0: a forward-only pass on the first training batch for plugins that want it."""
        active = [p for p in self.plugins if p.wants_step(0)]
        if not active:
            return
        batches = PluginBatches(self.train_iter_fn(0), self.pipeline)
        batches.active, batches.step = active, 0
        for plugin in active:
            plugin.on_step_begin(0, self.engine.module)
        with torch.no_grad():
            if self.pipeline:
                loss = self.engine.eval_batch(data_iter=batches)
            else:
                loss = self._micro_losses(batches, backward=False)
        for plugin in active:
            plugin.on_step_end(0, float(loss))

    # ---- logging ----------------------------------------------------------------------------
    def _log(self, force: bool = False) -> None:
        st, args = self.state, self.args
        if not st.losses or not (force or st.iteration % args.log_interval == 0):
            return
        values = torch.stack([loss for _, loss, _, _ in st.losses]).tolist()  # one sync per interval
        norms = _host_norms([norm for _, _, norm, _ in st.losses])  # and one for the grad norms
        z = {}  # one DP all-reduce and one host read per interval, on the ranks holding z terms
        if st.z_losses:
            z = dict(zip(st.z_losses, self._dp_mean(torch.stack(list(st.z_losses.values()))).tolist(),
                         strict=True))
        for (step, _, _, lr), loss, norm in zip(st.losses, values, norms, strict=True):
            tokens = step * self.tokens_per_step
            scalars = {"lm_loss": loss, "lr": lr}
            if norm is not None:
                scalars["grad_norm"] = norm
            if step in z:
                scalars["z_loss"] = z[step]
            self.monitor.scalars("train", scalars, step, tokens)
        for (step, _, _, _), value, norm in zip(st.losses, values, norms, strict=True):
            if not math.isfinite(value) or (norm is not None and not math.isfinite(norm)):
                raise finite_guard.non_finite_error(f"training loss is {value} (grad norm {norm})", step,
                                                    args.save)
        perf = self.throughput.report()
        if perf["mfu"] > 1.0 and not self._peak_warned:  # the figure MFU divides by cannot be right
            self._peak_warned = True
            self.monitor.line(f" warning: MFU {100 * perf['mfu']:.0f}% > 100%: the peak it divides by "
                              f"({self.throughput.peak_tflops:.4g} TFLOP/s/device) is too low, e.g. a CPU "
                              "peak measured while the machine was busy; measure it again with "
                              "--remeasure-peak on an idle machine, or pass --peak-tflops")
        perf["memory_gb"] = memory_gb(self.device)
        self.monitor.scalars("throughput", perf, st.iteration, st.iteration * self.tokens_per_step)
        lr = st.losses[-1][3]
        gn = f"{norms[-1]:.3f}" if norms[-1] is not None else "n/a"
        self.monitor.line(
            f" iteration {st.iteration:6d}/{args.train_iters} | consumed samples {st.consumed_samples} | "
            f"lm loss {values[-1]:.4f} | lr {lr:.3e} | grad norm {gn} | "
            f"tokens/s {perf['tokens_per_sec']:.0f} | TFLOP/s/dev {perf['tflops_per_device']:.3f} | "
            f"MFU {100 * perf['mfu']:.1f}% | mem {perf['memory_gb']:.2f} GB | "
            f"ETA {self.monitor.eta(st.iteration, self._start_iteration, args.train_iters)}"
        )
        st.losses, st.z_losses = [], {}
        if not self.memory_report and st.iteration >= min(2, args.train_iters):
            self._report_memory()  # from step 2 on the optimizer states exist: the steady-state peak

    def _report_memory(self) -> None:
        """Once, at the first log line from step 2: this rank's measured peak beside the planner's."""
        measured, how = self.memory.peak()
        planned = self.memory.planned
        self.memory_report = {"measured_bytes": measured, "planned_bytes": planned, "measured_as": how}
        ratio = f" ({measured / planned:.2f}x planned)" if planned and "RSS" not in how else ""
        self.monitor.line(f" memory: planned {planned / 2**30:.3f} GB/rank of tensors (python -m "
                          f"megapost.plan) | measured {measured / 2**30:.3f} GB ({how}){ratio}")

    def _grad_norm(self) -> Any:
        """The engine's global grad norm as it keeps it (a device tensor on some paths): converted
        only at log time, so a step costs no extra host sync."""
        norm = self.engine.get_global_grad_norm()
        return norm.detach() if isinstance(norm, torch.Tensor) else norm

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run the loop; a collective that times out or loses a peer ends it with a CollectiveFailure
        naming the collective and the ranks that stopped answering (hang_report)."""
        timeout_minutes = getattr(self.args, "distributed_timeout_minutes", 10.0)
        heartbeat = start_heartbeat(self.pstate.global_rank, self.pstate.world_size,
                                    lambda: self.state.iteration, timeout_minutes)
        try:
            return self._train()
        except RuntimeError as e:
            if heartbeat is None or not is_collective_error(e):
                raise
            raise explain(e, self.pstate.global_rank, self.state.iteration + 1, timeout_minutes,
                          heartbeat) from None
        finally:
            if heartbeat is not None:
                heartbeat.stop()

    def _train(self) -> dict[str, Any]:
        args, st = self.args, self.state
        self._start_iteration = st.iteration
        if st.iteration == 0:
            self.measure_at_init()
        self.batches = PluginBatches(self.train_iter_fn(st.consumed_samples), self.pipeline)
        history: dict[str, Any] = {"train_loss": {}, "valid_loss": {}}
        self.memory.reset()
        while st.iteration < args.train_iters:
            if self.fail_at == (self.pstate.global_rank, st.iteration + 1):
                raise RuntimeError(f"MEGAPOST_FAIL_RANK: rank {self.fail_at[0]} fails at iteration "
                                   f"{st.iteration + 1} on purpose")
            lr = self.engine.get_lr()[0]
            loss = self.train_step(st.iteration + 1)
            st.iteration += 1
            st.consumed_samples += args.global_batch_size
            self.throughput.tick(self.tokens_per_step)
            st.losses.append((st.iteration, loss, self._grad_norm(), lr))
            z = self._z_term()
            if z is not None:
                st.z_losses[st.iteration] = z
            history["train_loss"][st.iteration] = loss
            self._log()
            if args.eval_interval and st.iteration % args.eval_interval == 0:
                self._validate(history)
            if args.save and args.save_interval and st.iteration % args.save_interval == 0:
                self.save()
            for plugin in self.plugins:  # may call snapshot() / restore() below
                plugin.after_iteration(st.iteration, self)
            exit_reason = self.exits.check(st.iteration)
            if exit_reason:
                break
        else:
            exit_reason = None
        self._log(force=True)
        if args.eval_interval and st.iteration % args.eval_interval and not exit_reason:
            self._validate(history)
        if args.save and (not args.save_interval or st.iteration % args.save_interval):
            self.save()
        if exit_reason:
            self.monitor.line(f" exiting at iteration {st.iteration} ({exit_reason}); checkpoint: "
                              f"{last_checkpoint(args.save)}; resume with: {resume_command(args)}")
        history["train_loss"] = {k: float(v) for k, v in history["train_loss"].items()}
        history["memory"] = self.memory_report
        self.monitor.flush()
        return history

    def _validate(self, history: dict[str, Any]) -> None:
        loss = self.evaluate()
        history["valid_loss"][self.state.iteration] = loss
        tokens = self.state.iteration * self.tokens_per_step
        self.monitor.scalars("valid", {"lm_loss": loss, "ppl": math.exp(min(loss, 50.0))},
                             self.state.iteration, tokens)
        self.monitor.line(f" validation at iteration {self.state.iteration} | lm loss {loss:.4f} | "
                          f"ppl {math.exp(min(loss, 50.0)):.2f}")

    # ---- in-memory rollback, for plugins (Plugin.after_iteration; e.g. collapse_metrics' guard) ---------
    def snapshot(self) -> dict[str, Any]:
        """This rank's state to continue exactly from here (ZeRO-0 fp32: module and optimizer state_dict
        copied to host memory), the lr schedule, RNG and data position."""
        eng = self.engine
        return {"module": _to_host(eng.module.state_dict()),
                "optimizer": _to_host(eng.optimizer.state_dict()),
                "scheduler": eng.lr_scheduler.state_dict(), "rng": checkpoint_io.rng_state(),
                "iteration": self.state.iteration, "consumed_samples": self.state.consumed_samples,
                "global_steps": eng.global_steps, "global_samples": eng.global_samples}

    def restore(self, snap: dict[str, Any], skip_data: bool = False) -> None:
        """Return to ``snap``; ``skip_data`` keeps the data position (the window since is not retrained)."""
        self._log(force=True)
        eng = self.engine
        eng.module.load_state_dict(snap["module"])
        eng.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))  # it keeps (and updates) the tensors
        eng.lr_scheduler.load_state_dict(snap["scheduler"])
        checkpoint_io.set_rng_state(snap["rng"])
        eng.global_steps, eng.global_samples = snap["global_steps"], snap["global_samples"]
        self.state.iteration = snap["iteration"]
        if not skip_data:
            self.state.consumed_samples = snap["consumed_samples"]
        self.batches = PluginBatches(self.train_iter_fn(self.state.consumed_samples), self.pipeline)

    def save(self) -> None:
        pending = [t for _, loss, norm, _ in self.state.losses for t in (loss, norm)]
        finite_guard.refuse_non_finite(self.engine.module.parameters(), pending, self.state.iteration,
                                       self.args.save, self.device)
        states = {p.name: p.state_dict() for p in self.plugins}
        tag = checkpoint_io.save(self.engine, self.args, self.state.iteration, self.state.consumed_samples,
                                 states, self.pstate)
        self.monitor.line(f" saved checkpoint {self.args.save}/{tag}")

    def continue_logs(self, iteration: int, consumed: int) -> None:
        """Drop what earlier attempts logged past ``iteration`` (-1: everything) in this run's
        TensorBoard directory and the plugins' files, so steps never repeat or go backward."""
        for plugin in self.plugins:
            plugin.on_resume(iteration)
        self.monitor.resume(iteration, consumed * self.args.seq_length)

    def load(self) -> None:
        it, consumed, states = checkpoint_io.load(self.engine, self.args, self.pstate)
        self.state.iteration, self.state.consumed_samples = it, consumed
        for plugin in self.plugins:
            if plugin.name in states:
                plugin.load_state_dict(states[plugin.name])
        self.continue_logs(it, consumed)
        self.monitor.line(f" resumed from {self.args.load} at iteration {it} ({consumed} samples)")
