"""The training logger: per-interval monitor lines and TensorBoard scalars (loss, lr, grad norm, z-loss,
skipped iterations, throughput), the non-finite stop, and the one-time measured-vs-planned memory report.

A step whose grad norm is not finite was skipped (``megapost.optim.skips``): it is counted, not an
error; the run stops after ``--max-consecutive-skipped-iterations`` in a row, or at a non-finite loss
of a step that was not skipped (or where nothing skips: ZeRO-0 fp32 SGD)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megapost.checkpoint import finite_guard
from megapost.config.resolved import LoggingConfig
from megapost.metrics.monitor import Monitor
from megapost.metrics.throughput import PeakMemory, Throughput, memory_gb
from megapost.optim import param_stats
from megapost.optim.skips import SkipCounter


def host_norms(norms: list[Any]) -> list[float | None]:
    """Grad norms as floats, device tensors copied to the host in one transfer."""
    on_device = [i for i, n in enumerate(norms) if isinstance(n, torch.Tensor)]
    out: list[Any] = list(norms)
    if on_device:
        host = torch.stack([norms[i].detach().float().reshape(()) for i in on_device]).tolist()
        for i, value in zip(on_device, host, strict=True):
            out[i] = value
    return [None if n is None else float(n) for n in out]



def mfu_text(perf: dict[str, float], peak_tflops: float) -> str:
    """``MFU 41.0% (causal 37.2%)``: Megatron's convention first; unknown without a peak."""
    if peak_tflops <= 0 or "mfu" not in perf:
        return "MFU unknown: pass --peak-tflops"
    if perf["mfu"] > 1.0:  # impossible: the peak it divides by is too low (warned once)
        return "MFU n/a (above 100%: the peak is too low)"
    causal = f" (causal {100 * perf['mfu_causal']:.1f}%)" if "mfu_causal" in perf else ""
    return f"MFU {100 * perf['mfu']:.1f}%{causal}"

class ParamStats:
    """--log-params-norm and --log-num-zeros-in-grad (megapost.optim.param_stats): the zero count kept
    as a device tensor at each logging step's optimizer step, both summed over ranks and read at log
    time (every rank calls ``report`` at the same log lines)."""

    def __init__(self, engine: Any, tp_rank: int, dp_rank: int) -> None:
        self.engine, self.tp_rank, self.dp_rank = engine, tp_rank, dp_rank
        self.zeros: dict[int, torch.Tensor] = {}

    def count_zeros(self, step: int) -> None:
        self.zeros[step] = param_stats.local_zeros_in_grad(self.engine, self.tp_rank, self.dp_rank)

    def report(self, iteration: int, tokens_per_step: int, monitor: Monitor, options: LoggingConfig) -> str:
        """The log line's ``params norm X | num zeros N | `` (TensorBoard: train/params_norm, num_zeros)."""
        text, tb_step = "", iteration % options.tensorboard_log_interval == 0
        if options.log_params_norm:
            local = param_stats.local_params_sq(self.engine, self.tp_rank, self.dp_rank)
            norm = math.sqrt(param_stats.world_sum(local).item())
            text += f"params norm {norm:.3f} | "
            if tb_step:
                monitor.scalars("train", {"params_norm": norm}, iteration, iteration * tokens_per_step)
        if self.zeros:
            steps, local = list(self.zeros), torch.stack(list(self.zeros.values()))
            counts = param_stats.world_sum(local).tolist()
            for step, count in zip(steps, counts, strict=True):
                if step % options.tensorboard_log_interval == 0:
                    monitor.scalars("train", {"num_zeros": count}, step, step * tokens_per_step)
            text += f"num zeros {counts[-1]:.0f} | " if steps[-1] == iteration else ""
            self.zeros = {}
        return text


class TrainLogger:
    """Writes the steps a ``TrainState`` holds (``losses``, ``z_losses``) every ``log_interval``."""

    def __init__(self, monitor: Monitor, throughput: Throughput, memory: PeakMemory, device: torch.device,
                 options: LoggingConfig, train_iters: int, tokens_per_step: int, save_dir: str | None,
                 dp_mean: Callable[[torch.Tensor], torch.Tensor], stats: ParamStats | None = None,
                 global_batch_size: int = 0, max_consecutive_skips: int = 10) -> None:
        """``options``: --log-interval and Megatron's logging flags; ``stats``: what --log-params-norm and
        --log-num-zeros-in-grad read (None: neither is logged)."""
        self.monitor, self.throughput, self.memory, self.device = monitor, throughput, memory, device
        self.log_interval, self.train_iters, self.tokens_per_step = options.log_interval, train_iters, \
            tokens_per_step
        self.options, self.stats, self.global_batch_size = options, stats, global_batch_size
        self.save_dir, self.dp_mean, self.max_consecutive_skips = save_dir, dp_mean, max_consecutive_skips
        self.skips = SkipCounter(device, max_consecutive_skips)  # build.py installs the engine's
        self._skipped_logged = 0  # the skip total at the last log line (saved: a resume continues it)
        self._tb_through = 0  # the steps up to here are in TensorBoard (written at a save)
        self.memory_report: dict[str, Any] = {}
        self.start_iteration = 0
        self._peak_warned = False

    def _host_steps(self, st: Any) -> tuple[list[float], list[float | None], list[float | None]]:
        """The pending steps' losses, grad norms and lrs on the host."""
        values = torch.stack([loss for _, loss, _, _ in st.losses]).tolist()  # one sync per interval
        norms = host_norms([norm for _, _, norm, _ in st.losses])  # and one for the grad norms
        lrs = host_norms([lr for _, _, _, lr in st.losses])  # a device lr (sync-free steps): one more
        return values, norms, lrs

    def _tb_steps(self, st: Any, values: list[float], norms: list[float | None],
                  lrs: list[float | None]) -> None:
        """The pending steps' per-step TensorBoard scalars (those not yet written at a save)."""
        z = {}  # one DP all-reduce and one host read per interval, on the ranks holding z terms
        if st.z_losses:
            z = dict(zip(st.z_losses, self.dp_mean(torch.stack(list(st.z_losses.values()))).tolist(),
                         strict=True))
        for (step, _, _, _), loss, norm, lr in zip(st.losses, values, norms, lrs, strict=True):
            if step > self._tb_through and step % self.options.tensorboard_log_interval == 0:
                self.monitor.scalars("train", self._tb_scalars(loss, lr, norm, z.get(step)), step,
                                     step * self.tokens_per_step)
        self._tb_through = max(self._tb_through, st.iteration)

    def _write_steps(self, st: Any) -> tuple[list[float], list[float | None], list[float | None], int]:
        """The interval's scalars; returns the losses, grad norms, lrs and iterations skipped in it."""
        values, norms, lrs = self._host_steps(st)
        counts = self.skips.read()
        skipped, self._skipped_logged = counts.total - self._skipped_logged, counts.total
        self._tb_steps(st, values, norms, lrs)
        self.monitor.scalars("train", {"skipped_iterations": skipped}, st.iteration,
                             st.iteration * self.tokens_per_step)
        self._check_skips(st.iteration)
        self._check_finite(st, values, norms)
        return values, norms, lrs, skipped

    def before_save(self, st: Any) -> None:
        """Before a checkpoint of ``st``: the pending steps' TensorBoard scalars are written and flushed
        (a resume from this tag starts after them; without this, a kill before the next log line loses
        them), and a run that reached the consecutive-skip limit is stopped before it saves."""
        self._check_skips(st.iteration)
        if st.losses:  # (a non-finite pending step is refused by the save itself)
            self._tb_steps(st, *self._host_steps(st))
        self.monitor.flush()

    def skip_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the skip counts (device copies, the total at the last log line)."""
        return {**self.skips.state_dict(), "logged": self._skipped_logged}

    def load_skip_state(self, state: dict[str, Any], iteration: int) -> None:
        """Continue the counts of a checkpoint at ``iteration`` (a tag without them: from zero)."""
        self.skips.load_state_dict(state)
        self._skipped_logged = int(state.get("logged", 0))
        self._tb_through = iteration

    def rewind(self, iteration: int) -> None:
        """A rollback to ``iteration``: the steps after it are trained (and logged) again."""
        self._tb_through = min(self._tb_through, iteration)

    def _check_skips(self, iteration: int) -> None:
        """Stop (one line naming the last good checkpoint) once a run of consecutive skips reached
        --max-consecutive-skipped-iterations, also one that ended since the last check."""
        counts = self.skips.read()
        if counts.longest >= self.max_consecutive_skips:
            seen = f" (seen at iteration {iteration})" if counts.reached_at not in (0, iteration) else ""
            raise finite_guard.non_finite_error(
                f"{self.max_consecutive_skips} consecutive iterations skipped (non-finite gradient norm; "
                f"--max-consecutive-skipped-iterations {self.max_consecutive_skips}){seen}",
                counts.reached_at or iteration, self.save_dir)

    def _check_finite(self, st: Any, values: list[float], norms: list[float | None]) -> None:
        """Stop (one line naming the last good checkpoint) at a non-finite loss or grad norm that no
        skip absorbed."""
        for (step, _, _, _), value, norm in zip(st.losses, values, norms, strict=True):
            skipped = self.skips.mode != "none" and norm is not None and not math.isfinite(norm)
            if not skipped and (not math.isfinite(value) or (norm is not None and not math.isfinite(norm))):
                raise finite_guard.non_finite_error(f"training loss is {value} (grad norm {norm})", step,
                                                    self.save_dir)

    def _tb_scalars(self, loss: float, lr: float, norm: float | None, z: float | None) -> dict[str, float]:
        """One iteration's TensorBoard scalars, as Megatron's --log-*-to-tensorboard flags ask."""
        o = self.options
        scalars = {"lm_loss": loss}
        if o.log_learning_rate_to_tensorboard:
            scalars["lr"] = lr
        if norm is not None and o.log_gradient_norm_to_tensorboard:
            scalars["grad_norm"] = norm
        if z is not None:
            scalars["z_loss"] = z
        if o.log_batch_size_to_tensorboard:
            scalars["batch_size"] = self.global_batch_size
        if o.log_world_size_to_tensorboard:
            scalars["world_size"] = self.throughput.world_size
        return scalars

    def is_log_step(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.train_iters

    def before_optimizer_step(self, step: int) -> None:
        """Gradients reduced, not yet applied: --log-num-zeros-in-grad's count on logging steps only."""
        if self.stats is not None and self.options.log_num_zeros_in_grad and self.is_log_step(step):
            self.stats.count_zeros(step)

    def log(self, st: Any, force: bool = False) -> None:
        if not st.losses or not (force or st.iteration % self.log_interval == 0):
            return
        values, norms, lrs, skipped = self._write_steps(st)
        extra = "" if self.stats is None else self.stats.report(st.iteration, self.tokens_per_step,
                                                                 self.monitor, self.options)
        perf = self.throughput.report()
        if perf.get("mfu", 0.0) > 1.0 and not self._peak_warned:  # the figure MFU divides by cannot be right
            self._peak_warned = True
            self.monitor.line(f" warning: MFU {100 * perf['mfu']:.0f}% > 100%: the peak it divides by "
                              f"({self.throughput.peak_tflops:.4g} TFLOP/s/device) is too low, e.g. a CPU "
                              "peak measured while the machine was busy; measure it again with "
                              "--remeasure-peak on an idle machine, or pass --peak-tflops")
        perf["memory_gb"] = memory_gb(self.device)
        shown = {k: v for k, v in perf.items() if not (k.startswith("mfu") and perf["mfu"] > 1.0)}
        self.monitor.scalars("throughput", shown, st.iteration, st.iteration * self.tokens_per_step)
        lr = lrs[-1]
        gn = f"{norms[-1]:.3f}" if norms[-1] is not None else "n/a"
        self.monitor.line(
            f" iteration {st.iteration:6d}/{self.train_iters} | consumed samples {st.consumed_samples} | "
            f"lm loss {values[-1]:.4f} | lr {lr:.3e} | grad norm {gn} | {extra}"
            f"skipped iterations {skipped} | "
            f"tokens/s {perf['tokens_per_sec']:.0f} | TFLOP/s/dev {perf['tflops_per_device']:.3f} | "
            f"{mfu_text(perf, self.throughput.peak_tflops)} | mem {perf['memory_gb']:.2f} GB | "
            f"ETA {self.monitor.eta(st.iteration, self.start_iteration, self.train_iters)}"
        )
        st.losses, st.z_losses = [], {}
        if not self.memory_report and st.iteration >= min(2, self.train_iters):
            self.report_memory()  # from step 2 on the optimizer states exist: the steady-state peak

    def report_memory(self) -> None:
        """Once, at the first log line from step 2: this rank's measured peak beside the planner's."""
        measured, how = self.memory.peak()
        planned = self.memory.planned
        self.memory_report = {"measured_bytes": measured, "planned_bytes": planned, "measured_as": how}
        ratio = f" ({measured / planned:.2f}x planned)" if planned and "RSS" not in how else ""
        self.monitor.line(f" memory: planned {planned / 2**30:.3f} GB/rank of tensors (python -m "
                          f"megapost.plan) | measured {measured / 2**30:.3f} GB ({how}){ratio}")
