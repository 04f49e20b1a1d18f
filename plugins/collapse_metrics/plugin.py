"""``--plugins collapse_metrics``: the Post-Norm collapse measurements (shared/paper/QUANTITIES.md).

On every measured step (``--collapse-interval``; step 0 with ``--collapse-at-init``), from the step's
own training micro-batches (no extra forward or backward), per selected layer l and sublayer k:
t_sim of X_k^l, Y_k^l and the normalised output, the residual norm mean_i ||y_i||, the RMS factor
sqrt(d)/||u_i|| of the norm input (mean/min/max; null without a residual-stream RMSNorm),
alpha_k^l = ||dL/dX_k^l||_F / ||dL/dY_k^l||_F (squared norms pooled over micro-batches and ranks),
c = alpha * mean RMS factor, and the layer's parameter-gradient norms before the optimizer step; per
step t_sim of the embeddings and of X^H, the loss beside the frequency loss of the same labels
(aggregated, per-sequence, running), and a transition flag (``transition.py``). Nothing is attached on
other steps. What each quantity is under every ``--norm-position``, and where it is null:
docs/placements.md.

Rank roles: probes are listened to where the residual stream is not a replica (every rank under
sequence parallelism, else tensor-parallel rank 0); labels are counted on tensor-parallel rank 0 of
the last pipeline stage; the logging rank writes (``writers.py``). Reductions: ``reduce.py``.

Cost: the statistics are taken on the device in one batched pass per step (``recorder.py``,
``grads.py``), reduced there, and copied to the host without waiting (``reduce.ReadBack``); the host
reads a measured step's values at the next iteration's ``after_iteration`` (at once under
``--collapse-guard`` / ``--collapse-autopsy``, which act on the step itself; and before a checkpoint's
``state_dict``), and figures are drawn off the training thread (``writers.py``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import deque
from typing import Any

import torch
from torch import nn

from megapost.plugin_api import DatasetReader, Plugin, PluginContext

from .autopsy import Autopsy, add_autopsy_arguments, check_autopsy_args
from .config import CollapseConfig
from .corpus import train_split_frequency_loss
from .early_warning import DEFAULT_FACTOR, EarlyWarning, deepest_resid_norm, early_warning_applies
from .frequency import RunningFrequencyLoss
from .grads import LayerParameters
from .guard import Guard, add_guard_arguments, check_guard_args
from .recorder import Recorder
from .reduce import ReadBack, reduce_buffer, sum_over_group
from .state import CollapseState, StateConfig, grad_ratio
from .table import StatsBuffer, layer_records, parse_layers, site_tsim
from .transition import TransitionConfig, TransitionDetector
from .writers import Writers

HEATMAP_IMAGES = 5


def image_interval(flags: CollapseConfig, train_iters: int) -> int:
    """``--collapse-image-interval``, or by default about HEATMAP_IMAGES images over the run."""
    if flags.collapse_image_interval is not None:
        return flags.collapse_image_interval
    measured = max(1, train_iters or 0) // flags.collapse_interval
    return max(1, round(measured / HEATMAP_IMAGES))


def corpus_frequency_loss(data: DatasetReader, seq_length: int, vocab_size: int) -> float | None:
    """The train split's frequency loss (``corpus.py``, cached beside the index cache), printed once;
    None without a --data-path dataset."""
    if not data.prefix or not os.path.isfile(f"{data.prefix}.idx"):
        return None
    result = train_split_frequency_loss(data, seq_length, vocab_size)
    print(f"[collapse] frequency loss of the train split: {result.aggregated:.4f} nats "
          f"({result.num_tokens:,} labels; per sequence {result.per_sequence:.4f})", flush=True)
    return result.aggregated


class CollapseMetricsPlugin(Plugin):
    name = "collapse_metrics"
    loss_on_device = True  # on_step_end gets the loss as a device tensor: no host read in the step
    config_class = CollapseConfig  # its flags, typed (config.py)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("collapse metrics (--plugins collapse_metrics)")
        g.add_argument("--collapse-interval", type=int, default=1, metavar="N",
                       help="measure every N-th optimizer step")
        g.add_argument("--collapse-layers", default="", metavar="LIST",
                       help="layers to measure, 1-based, e.g. '1,2,47-48' (default: all)")
        g.add_argument("--collapse-at-init", action="store_true",
                       help="also measure a forward-only pass at step 0 (alpha and grad norms null)")
        g.add_argument("--collapse-image-interval", type=int, default=None, metavar="N",
                       help="depth-profile and heatmap images every N measured steps (0: never; default: "
                       f"about {HEATMAP_IMAGES} per run)")
        defaults = TransitionConfig()
        g.add_argument("--collapse-transition-beta", type=float, default=defaults.beta,
                       help="EMA decay of the detector's mean/variance per measured step")
        g.add_argument("--collapse-transition-z", type=float, default=defaults.z_min,
                       help="z-score both t_sim(X^H) and the loss must reach")
        g.add_argument("--collapse-transition-min-tsim-rise", type=float, default=defaults.min_tsim_rise,
                       help="minimum absolute rise of t_sim(X^H) over its EMA")
        g.add_argument("--collapse-transition-min-loss-rise", type=float, default=defaults.min_loss_rise,
                       help="minimum rise of the loss over its EMA, relative to the EMA")
        g.add_argument("--collapse-transition-warmup", type=int, default=defaults.warmup,
                       help="measured steps before the detector may fire")
        state = StateConfig()
        g.add_argument("--collapse-state-tsim", type=float, default=state.tsim_min,
                       help="collapsed-state alarm: t_sim(X^H) at least this ...")
        g.add_argument("--collapse-state-grad-ratio", type=float, default=state.grad_ratio_max,
                       help="... and first/last-layer parameter-gradient ratio at most this (state.py)")
        g.add_argument("--collapse-early-warning", action="store_true",
                       help="warn when the deepest layer's residual norm reaches a factor times its running "
                       "minimum (placements that normalise the deepest residual sum after the add: post, "
                       "deepnorm, all-Post mix; early_warning.py)")
        g.add_argument("--collapse-early-warning-factor", type=float, default=DEFAULT_FACTOR, metavar="F",
                       help="growth factor of the early warning")
        add_guard_arguments(g)
        add_autopsy_arguments(g)

    def __init__(self, ctx: PluginContext) -> None:
        super().__init__(ctx)
        flags, run, ps, services = ctx.config, ctx.run, ctx.parallel, ctx.services
        if flags.collapse_interval < 1:
            raise ValueError(f"--collapse-interval must be >= 1, got {flags.collapse_interval}")
        self.interval, self.at_init = flags.collapse_interval, flags.collapse_at_init
        self.layers = parse_layers(flags.collapse_layers, run.num_layers)
        self.vocab_size = run.vocab_size
        self.listens = ps.sequence_parallel or ps.tp_rank == 0
        self.counts_labels = ps.is_last_stage and ps.tp_rank == 0
        self.detector = TransitionDetector(TransitionConfig(
            beta=flags.collapse_transition_beta, z_min=flags.collapse_transition_z,
            min_tsim_rise=flags.collapse_transition_min_tsim_rise,
            min_loss_rise=flags.collapse_transition_min_loss_rise, warmup=flags.collapse_transition_warmup))
        self.state = CollapseState(StateConfig(flags.collapse_state_tsim, flags.collapse_state_grad_ratio))
        armed = early_warning_applies(services.model, self.layers)
        self.warning = (EarlyWarning(flags.collapse_early_warning_factor)
                        if flags.collapse_early_warning and armed else None)
        if flags.collapse_early_warning and self.warning is None and ps.is_logging_rank:
            print(f"[collapse] early warning off: under --norm-position {run.norm_position} the residual sum "
                  f"of layer {max(self.layers)} is not normalised after the add, so it grows by design (the "
                  "warning reads the Post-Norm mechanism; docs/placements.md)", flush=True)
        check_guard_args(flags, run, services.law)
        self.guard = Guard(flags, run, services.law) if flags.collapse_guard else None
        check_autopsy_args(flags, run, ps.world_size)
        self.autopsy = Autopsy(flags, ctx.tensorboard_dir) if flags.collapse_autopsy else None
        self.guard_event: tuple[int, str] | None = None  # (step, event) for the guard's after_iteration
        self.autopsy_event: int | None = None
        self.running = RunningFrequencyLoss(run.vocab_size)
        self.init_counted = False  # step 0 measured the first batch, which step 1 trains on again
        self.step_labels = RunningFrequencyLoss(run.vocab_size)
        images = image_interval(flags, run.train_iters)
        self.writers = (Writers(ctx.writer, ctx.tensorboard_dir, self.layers, images)
                        if ps.is_logging_rank else None)
        self.freq_corpus = (corpus_frequency_loss(services.data, run.seq_length, run.vocab_size)
                            if ps.is_logging_rank else None)
        self.model: nn.Module | None = None
        self.buf: StatsBuffer | None = None
        self.recorder: Recorder | None = None
        self.params: LayerParameters | None = None
        self.params_of: nn.Module | None = None
        self._last: dict[str, Any] = {}
        self.read_backs: deque[ReadBack] = deque()  # measured steps reduced, not yet read by the host
        self.defer = self.guard is None and self.autopsy is None  # the guard/autopsy act on the step itself

    @property
    def last(self) -> dict[str, Any]:
        """The latest measured step's records (for tests and tools; reads any pending step first)."""
        self.read_pending()
        return self._last

    # ---- hooks ---------------------------------------------------------------------------------
    def on_model_built(self, model: nn.Module) -> None:
        self.model = model

    def wants_step(self, step: int) -> bool:
        if self.autopsy is not None and self.autopsy.dense(step):
            return True
        return self.at_init if step == 0 else step % self.interval == 0

    def on_step_begin(self, step: int, model: nn.Module) -> None:
        self.model = model
        device = next(model.parameters()).device
        if self.buf is None or self.buf.device != device:
            self.buf = StatsBuffer(self.layers, self.vocab_size, device)
            self.recorder = Recorder(self.buf, self.ctx.parallel.sequence_parallel)
        else:
            self.buf.reset()
        self.recorder.begin_step()
        self.step_labels.reset()
        if self.listens:
            self.ctx.services.model.listen(model, self.recorder)

    def on_micro_batch(self, step: int, batch: dict[str, Any]) -> None:
        if self.counts_labels:
            self.step_labels.update(batch["labels"], batch.get("loss_mask"))
        if self.autopsy is not None:
            self.autopsy.on_micro_batch(step, batch)

    def before_optimizer_step(self, step: int) -> None:
        module = self.model  # the module on_step_begin listened to
        if self.params is None or self.params_of is not module:
            blocks = self.ctx.services.model.blocks(module)
            self.params, self.params_of = LayerParameters(blocks, self.buf.row), module
        self.params.add_squared_norms(self.buf["grad"], self.ctx.owned_grad)
        if self.autopsy is not None:
            self.autopsy.before_optimizer_step(step, module)

    def on_step_end(self, step: int, loss: float | torch.Tensor | None) -> None:
        self.ctx.services.model.listen(self.model, None)
        ps, buf, comm = self.ctx.parallel, self.buf, self.ctx.services.collectives
        partials = self.recorder.end_step()
        if partials is not None:
            summed = sum_over_group(comm, partials, ps.tp_group)
            if ps.tp_rank == 0:
                self.recorder.finish_sequence_parallel(summed)
        labels = self.step_labels
        host = {"labels": labels.counts, "label_seq": [labels.seq_entropy_sum, labels.num_sequences]}
        for part, value in host.items():
            buf[part].copy_(torch.as_tensor(value, dtype=torch.float64), non_blocking=True)
        if ps.is_logging_rank:
            value = torch.as_tensor(math.nan if loss is None else loss, dtype=torch.float64).reshape(())
            buf["loss"][0].copy_(value, non_blocking=True)
            buf["loss"][1].fill_(1.0)
        self.read_backs.append(ReadBack(step, reduce_buffer(comm, buf)))
        if not self.defer:
            self.read_pending()

    def read_pending(self, before: int | None = None) -> None:
        """Finish the reduced steps (those before step ``before``; all by default) in step order."""
        while self.read_backs and (before is None or self.read_backs[0].step < before):
            read = self.read_backs.popleft()
            self._finish(read.step, self.buf.unflatten(read.value()))

    def _finish(self, step: int, reduced: dict[str, torch.Tensor]) -> None:
        records = layer_records(reduced, self.layers)
        step_freq = RunningFrequencyLoss(self.vocab_size)
        entropy_sum, sequences = reduced["label_seq"].tolist()
        step_freq.load_state_dict({"vocab_size": self.vocab_size, "counts": reduced["labels"].round().long(),
                                   "seq_entropy_sum": entropy_sum, "num_sequences": int(round(sequences))})
        if not (step == 1 and self.init_counted):
            self.running.merge(step_freq)
        self.init_counted = step == 0
        loss_sum, loss_count = reduced["loss"].tolist()
        loss = loss_sum / loss_count if loss_count and math.isfinite(loss_sum) else None
        tsim_head = site_tsim(reduced, "head")
        event = self.detector.update(step, tsim_head, loss) if step > 0 else None
        ratio = grad_ratio(records)
        collapsed, alarm = self.state.update(step, tsim_head, ratio)
        warned, warn_line = (None, None) if self.warning is None else \
            self.warning.update(step, deepest_resid_norm(records))
        if self.guard is not None and (alarm if self.guard.on == "alarm" else warn_line) and \
                (collapsed if self.guard.on == "alarm" else warned):
            self.guard_event = (step, "COLLAPSED" if self.guard.on == "alarm" else "early warning")
        if self.autopsy is not None and (alarm if self.autopsy.on == "alarm" else warn_line):
            self.autopsy_event = step
        has_labels = step_freq.num_tokens > 0
        step_record = {
            "loss": loss,
            "freq_loss_agg": step_freq.value() if has_labels else None,
            "freq_loss_seq": step_freq.per_sequence_value() if has_labels else None,
            "freq_loss_running": self.running.value() if self.running.num_tokens else None,
            "freq_loss_corpus": self.freq_corpus,
            "t_sim_embed": site_tsim(reduced, "embed"), "t_sim_head": tsim_head,
            "transition": event is not None, "grad_ratio": ratio, "collapsed": collapsed,
            "early_warning": warned,
        }
        self._last = {"step": step, "layers": records, "step_record": step_record}
        if self.writers is not None:
            self.writers.write(step, records, step_record)
            for line in (event.line() if event is not None else None, alarm, warn_line):
                if line is not None:
                    print(line, flush=True)
                    self.writers.alert(step, line)

    def after_iteration(self, iteration: int) -> None:
        self.read_pending(before=iteration)
        if self.autopsy is not None:
            event = self.autopsy_event == iteration
            line = self.autopsy.after_iteration(iteration, self.ctx, self.model, event,
                                                (self._detectors_state, self._load_detectors))
            self.autopsy_event = None
            if line is not None and self.writers is not None:
                print(line, flush=True)
                self.writers.alert(iteration, line)
        if self.guard is None:
            return
        event = self.guard_event[1] if self.guard_event and self.guard_event[0] == iteration else None
        self.guard_event = None
        healthy = not self.state.collapsed and not (self.warning is not None and self.warning.warned_at)
        record = self.guard.after_iteration(iteration, self.ctx, event, healthy,
                                            (self._detectors_state, self._load_detectors))
        if record is not None and self.writers is not None:
            print(record["line"], flush=True)
            self.writers.alert(iteration, record["line"])
            self.writers.guard(iteration, record)

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the detectors' state and the logging rank's record (alarm steps,
        heatmap history), so a resumed run continues one record."""
        self.read_pending()  # a measured step not yet read belongs to the state saved
        state = self._detectors_state()
        if self.writers is not None:
            state["writers"] = self.writers.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_detectors(state)
        if "writers" in state and self.writers is not None:
            self.writers.load_state_dict(state["writers"])

    def _detectors_state(self) -> dict[str, Any]:
        """The state a guard rollback or autopsy replay rewinds (the record itself is not rewound)."""
        state = {"running": self.running.state_dict(), "detector": self.detector.state_dict(),
                 "state": self.state.state_dict()}
        if self.warning is not None:
            state["early_warning"] = self.warning.state_dict()
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def _load_detectors(self, state: dict[str, Any]) -> None:
        if "running" in state:
            self.running.load_state_dict(state["running"])
        if "detector" in state:
            self.detector.load_state_dict(state["detector"])
        if "state" in state:
            self.state.load_state_dict(state["state"])
        if "early_warning" in state and self.warning is not None:
            self.warning.load_state_dict(state["early_warning"])
        if "guard" in state and self.guard is not None:
            self.guard.load_state_dict(state["guard"])

    def on_resume(self, iteration: int) -> None:
        if self.writers is not None:
            self.writers.drop_after(iteration)

    def close(self) -> None:
        self.read_pending()
        if self.writers is not None:
            self.writers.close()

