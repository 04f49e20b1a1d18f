"""The Trainer: composes its parts (megapost/train/: step runner, evaluator, logger, checkpoint manager,
plugin host, watchdog) and runs the loop of ``--train-iters`` optimizer steps. Built by
``megapost.train.build.build``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megapost.config.resolved import Config
from megapost.ds_adapter.deepspeed_engine import DeepSpeedEngine
from megapost.metrics.monitor import Monitor
from megapost.metrics.throughput import PeakMemory, Throughput
from megapost.parallel.state import ParallelState
from megapost.plugin_api import Plugin
from megapost.runtime.interrupts import Progress, resume_command
from megapost.train.checkpoints import CheckpointManager
from megapost.train.evaluator import Evaluator
from megapost.train.logger import ParamStats, TrainLogger, host_norms
from megapost.train.plugin_host import PluginBatches, PluginHost
from megapost.train.step import StepRunner
from megapost.train.watchdog import Watchdog
from megapost.utils.faults import NO_FAULTS, FaultInjector

__all__ = ["PluginBatches", "TrainState", "Trainer"]


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: list[tuple[int, torch.Tensor, Any, float]] = field(default_factory=list)
    z_losses: dict[int, torch.Tensor] = field(default_factory=dict)  # --z-loss: the z term per step


class Trainer:
    """Owns the engine and runs ``--train-iters`` optimizer steps."""

    def __init__(self, config: Config, engine: DeepSpeedEngine, loss_fn: Any,
                 pstate: ParallelState, train_iter_fn: Callable[[int], Iterator[Any]] | None,
                 valid_iter_fn: Callable[[], Iterator[Any] | None] | None, plugins: list[Plugin],
                 monitor: Monitor, peak_tflops: float, device: torch.device,
                 memory: PeakMemory | None = None, faults: FaultInjector = NO_FAULTS,
                 schedule: Any = None, progress: Progress | None = None) -> None:
        """``config``: the resolved sections the parts read; ``schedule``: the lr schedule the engine
        steps (megapost.optim.schedule; plugins' lr requests rescale it); ``progress``: the run's
        interrupt state (megapost.runtime.interrupts), owned from here on."""
        self.config, self.engine, self.pstate = config, engine, pstate
        self.monitor, self.device = monitor, device
        self.state = TrainState()
        self.progress = progress or Progress(save=config.checkpoint.save)
        self.progress.state = self.state  # what the interrupt line names
        batch, run, ckpt = config.engine.batch, config.runtime, config.checkpoint
        self.tokens_per_step = batch.global_batch_size * config.model.seq_length
        self.host = PluginHost(plugins)
        par = config.parallel  # DeepSpeed's pipeline engine runs its own batches (the native engine's: dicts)
        ds_pipeline = par.pipeline_model_parallel_size > 1 and not config.engine.distributed_optimizer
        self.runner = StepRunner(engine, loss_fn, pstate, device, batch.grad_accum_steps, ds_pipeline,
                                 self.host, train_iter_fn)
        self.evaluator = Evaluator(self.runner, valid_iter_fn, run.eval_iters, monitor, self.tokens_per_step,
                                   faults)
        throughput = Throughput(config.model.flops_per_token(), pstate.world_size, peak_tflops,
                                config.model.flops_per_token(causal=True))
        log = config.logging
        stats = ParamStats(engine, pstate.tp_rank, pstate.dp_rank) \
            if log.log_params_norm or log.log_num_zeros_in_grad else None
        self.logger = TrainLogger(monitor, throughput, memory or PeakMemory(device), device, log,
                                  run.train_iters, self.tokens_per_step, ckpt.save, self.runner.dp_mean,
                                  stats, batch.global_batch_size, run.max_consecutive_skipped_iterations)
        self.checkpoints = CheckpointManager(config, engine, pstate, self.state, self.host, monitor, device,
                                             self.logger, faults)
        self.watchdog = Watchdog(run, config.parallel.distributed_timeout_minutes, pstate, self.progress,
                                 faults)
        self.host.bind(engine, schedule, config.optimizer, self.snapshot, self.restore)  # through the Engine

    @property
    def plugins(self) -> list[Plugin]:
        return self.host.plugins

    # ---- what plugins, benchmarks and pretrain call ----------------------------------------
    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step (benchmarks call it directly: the data starts where the state is)."""
        if self.runner.batches is None:
            self.runner.start_data(self.state.consumed_samples)
        return self.runner.train_step(step)

    def before_optimizer_step(self) -> None:
        """The engine hook (megapost.optim.hooks): gradients reduced, not yet applied."""
        self.checkpoints.before_state_changes()  # an async save's snapshot is taken before the step
        self.logger.before_optimizer_step(self.state.iteration + 1)  # --log-num-zeros-in-grad
        self.host.before_optimizer_step(self.state.iteration + 1)

    def evaluate(self) -> float:
        return self.evaluator.evaluate()

    def save(self) -> None:
        self.logger.before_save(self.state)  # the pending steps in TensorBoard first; the skip limit
        self.checkpoints.save()

    def load(self) -> None:
        self.checkpoints.load()

    def continue_logs(self, iteration: int, consumed: int) -> None:
        self.checkpoints.continue_logs(iteration, consumed)

    def snapshot(self) -> dict[str, Any]:
        """In-memory rollback point for plugins (Plugin.after_iteration; e.g. collapse_metrics' guard)."""
        return self.checkpoints.snapshot()

    def restore(self, snap: dict[str, Any], skip_data: bool = False) -> None:
        """Return to ``snap``; ``skip_data`` keeps the data position (the window since is not retrained)."""
        self.logger.log(self.state, force=True)
        self.checkpoints.restore(snap, skip_data)
        self.logger.rewind(self.state.iteration)
        self.runner.start_data(self.state.consumed_samples)

    @property
    def memory_report(self) -> dict[str, Any]:
        return self.logger.memory_report

    def close(self) -> None:
        """The plugins' and the writers' files closed, and the engine destroyed: DeepSpeed's gradient
        hooks and parameter mappings hold its optimizer (fp32 masters, moments, gradient buffers) alive
        from the model's parameters until then. The module's weights stay readable."""
        self.host.close()
        self.monitor.close()
        self.engine.destroy()

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run the loop under the watchdog (a hung or dead rank ends it with a CollectiveFailure); an
        interrupt or error still lets a background (--async-save) write complete."""
        try:
            return self.watchdog.run(self._train, lambda: self.state.iteration)
        finally:
            self.checkpoints.wait(raise_errors=False)

    def _step(self, history: dict[str, Any]) -> str | None:
        """One iteration: step, record, log, evaluate, save, plugins; returns why to stop (or None)."""
        run, st, runner = self.config.runtime, self.state, self.runner
        self.watchdog.before_step(st.iteration + 1)
        self.checkpoints.poll()  # a background save: published, or its failure raised, on every rank
        if st.iteration + 1 in run.iterations_to_skip:
            return self._skip_iteration()
        lr = self.engine.lr()
        lr = lr.clone() if isinstance(lr, torch.Tensor) else lr  # a device lr changes in place
        self.logger.skips.iteration = st.iteration + 1  # where a run of skips reaching the limit is
        loss = runner.train_step(st.iteration + 1)
        st.iteration += 1
        st.consumed_samples += self.config.engine.batch.global_batch_size
        self.logger.throughput.tick(self.tokens_per_step)
        st.losses.append((st.iteration, loss, runner.grad_norm(), lr))
        z = runner.z_term()
        if z is not None:
            st.z_losses[st.iteration] = z
        history["train_loss"][st.iteration] = loss
        history["grad_norm"][st.iteration] = st.losses[-1][2]
        self.logger.log(st)
        if run.eval_interval and st.iteration % run.eval_interval == 0:
            self.evaluator.validate(st.iteration, history)
        if self._save_due(st.iteration):
            self.save()
        self.host.after_iteration(st.iteration)  # may roll back (snapshot / restore) and scale the lr
        return self.watchdog.exit_reason(st.iteration)

    def _skip_iteration(self) -> str | None:
        """--iterations-to-skip (Megatron-LM's meaning): this iteration's batches are consumed, nothing
        steps (weights, optimizer and lr schedule unchanged), the iteration and data position advance."""
        st = self.state
        self.runner.skip_batches()
        st.iteration += 1
        st.consumed_samples += self.config.engine.batch.global_batch_size
        self.monitor.line(f" iteration {st.iteration}: batches skipped (--iterations-to-skip)")
        if self._save_due(st.iteration):
            self.save()
        return self.watchdog.exit_reason(st.iteration)

    def _save_due(self, iteration: int) -> bool:
        ckpt = self.config.checkpoint
        return bool(ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0)

    def _train(self) -> dict[str, Any]:
        run, ckpt, log, st = self.config.runtime, self.config.checkpoint, self.config.logging, self.state
        self.logger.start_iteration = st.iteration
        if st.iteration >= run.train_iters:  # a resumed run that is already done: no step, no save
            self.monitor.line(f" nothing to train: the run is at iteration {st.iteration} of --train-iters "
                              f"{run.train_iters}; raise --train-iters (or --train-samples) to go on")
            return {"train_loss": {}, "valid_loss": {}, "grad_norm": {}, "memory": {}}
        if st.iteration == 0:
            self.runner.measure_at_init()
        self.runner.start_data(st.consumed_samples)
        history: dict[str, Any] = {"train_loss": {}, "valid_loss": {}, "grad_norm": {}}
        self.logger.memory.reset()
        exit_reason = None
        while st.iteration < run.train_iters and not exit_reason:
            exit_reason = self._step(history)
        self.logger.log(st, force=True)
        if run.eval_interval and st.iteration % run.eval_interval and not exit_reason:
            self.evaluator.validate(st.iteration, history)
        if ckpt.save and (not ckpt.save_interval or st.iteration % ckpt.save_interval):
            self.save()
        self.checkpoints.wait()  # the end of training waits for a background save
        if exit_reason:
            self.monitor.line(f" exiting at iteration {st.iteration} ({exit_reason}); checkpoint: "
                              f"{self.progress.last_checkpoint()}; resume with: "
                              f"{resume_command(ckpt.save, log.run_name, log.runs_dir)}")
        history["train_loss"] = {k: float(v) for k, v in history["train_loss"].items()}
        history["grad_norm"] = dict(zip(history["grad_norm"],
                                        host_norms(list(history["grad_norm"].values())), strict=True))
        history["memory"] = self.logger.memory_report
        self.monitor.flush()
        return history
