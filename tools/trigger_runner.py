"""The trigger experiment's replicas inside one training process (``tools/trigger_experiment.py run``).

The real trainer (``megapost.train.build``, ``--plugins collapse_metrics``) trains the base run; a
``Controller`` added to its plugin host takes in-memory snapshots (the rollback service of the guard:
``Trainer.snapshot`` / ``restore``, exact for ZeRO-0 fp32) at the snapshot steps, then replays each job
(snapshot S, replica r, intervention) from its snapshot: the state restored with the data position moved
by r * ``offset`` samples (the only difference between replicas of one snapshot), the intervention set,
trained to ``end_step`` (or until ``events.from_series`` confirms a delayed collapse: the same answer the
full series would give), and its record appended to ``replicas.jsonl``.

Interventions (from the snapshot on, for the whole replica):

* ``wo_lr0.1``: the lr of the top ``top_layers`` layers' W_O times 0.1 -- after each optimizer step
  those matrices are moved back to pre + 0.1 (post - pre), which is AdamW's update at a tenth of the lr
  (the moments do not depend on the lr; the global gradient clip is unchanged);
* ``eps1e-6``: Adam's epsilon 1e-6 in every param group (the configured one is --adam-eps 1e-8);
* ``freeze_gains``: every norm gain (``*norm.weight``) set back to its value before each step;
* ``wo1_lr0.1``: the same for layer 1's W_O only (the layer whose attention grows in the base run);
* ``replay``: nothing -- the control replayed from the snapshot (a check that a replay reproduces it).

Each replica's own measured steps go to ``series/S<snapshot>_r<replica>_<intervention>.csv`` (the base
run's to ``series/base.csv``): ``step, loss, t_sim_head, grad_ratio``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megapost.plugin_api import Plugin
from megapost.study.events import DELAYED, from_series
from megapost.study.trigger import CONTROL, SCHEMA, VERSION, final_gap, series_name
from megapost.utils.atomic import atomic_write_text

INTERVENTIONS = (CONTROL, "wo_lr0.1", "eps1e-6", "freeze_gains", "wo1_lr0.1", "replay")
WO_LR_FACTOR, EPS = 0.1, 1e-6
CHECK_EVERY = 50  # steps between the early-stop checks of a replica


class Done(Exception):
    """Every job has its record: ends the training loop."""


@dataclass(frozen=True)
class Job:
    snapshot: int
    replica: int
    intervention: str


@dataclass
class Plan:
    """What to run: snapshot steps, replicas per snapshot, interventions at which snapshots."""

    snapshots: tuple[int, ...]
    replicas: int
    end_step: int
    offset: int  # samples between the data windows of two replicas
    lag: int  # features measured this many steps after the snapshot
    interval: int  # --collapse-interval
    top_layers: int
    intervene_at: tuple[int, ...] = ()
    interventions: tuple[str, ...] = ()
    controls: bool = True  # False: only the interventions (their controls come from another folder)
    done: set[Job] = field(default_factory=set)

    def jobs(self) -> list[Job]:
        """The replays still to run (replica 0 of a control is the base run itself, not a replay): the
        controls from the latest snapshot back (the cheapest first), then the interventions replica by
        replica."""
        todo = [Job(s, r, CONTROL) for s in reversed(self.snapshots) for r in range(1, self.replicas)
                if self.controls]
        todo += [Job(s, r, iv) for s in self.intervene_at for r in range(self.replicas)
                 for iv in self.interventions]
        return [j for j in todo if j not in self.done]


def attention_amount(module: torch.nn.Module, head_dim: int) -> list[float]:
    """Per layer: sum over heads of ||W_V^h W_O^h||_F^2 / d, the attention a layer adds through
    W_V W_O (QUANTITIES.md: s = d sigma_W^2 for a Gaussian W of entry variance sigma_W^2)."""
    out = []
    for layer in module.layers:
        wv, wo = layer.attention.wv.weight.detach(), layer.attention.wo.weight.detach()
        d = wo.shape[0]
        total = 0.0
        for h in range(wo.shape[1] // head_dim):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            # y = x W_V^h W_O^h with W_V^h = wv[cols].T (d x d_h) and W_O^h = wo[:, cols].T (d_h x d)
            total += float(torch.linalg.matrix_norm(wv[cols].T @ wo[:, cols].T) ** 2)
        out.append(total / d)
    return out


class Controller(Plugin):
    """Snapshots, replays, interventions and records (see the module docstring)."""

    name = "trigger"

    def __init__(self, trainer: Any, metrics: Any, plan: Plan, out: Path,
                 base_done: Callable[[int], bool], log: Callable[[str], None] = print) -> None:
        self.trainer, self.metrics, self.plan, self.out, self.log = trainer, metrics, plan, out, log
        self.module = trainer.engine.ds.module
        self.optimizer = trainer.engine.ds.optimizer
        self.head_dim = self.module.config.hidden_size // self.module.config.num_attention_heads
        self.freq_loss = float(metrics.freq_corpus)
        self.snaps: dict[int, dict[str, Any]] = {}  # step -> trainer snapshot, base series, features
        self.queue = plan.jobs()
        self.base_records = [s for s in plan.snapshots if not base_done(s)]
        self.job: Job | None = None  # None: the base run
        self.series: list[tuple[int, Any, Any, Any]] = []
        self.features: dict[str, Any] | None = None
        self.base_features: dict[int, dict[str, Any]] = {}
        self.params: list[torch.nn.Parameter] = []
        self.pre: list[torch.Tensor] = []
        self.started = time.monotonic()

    # ---- the trainer's hook --------------------------------------------------------------------
    def after_iteration(self, iteration: int) -> None:
        self._intervene()
        if iteration % self.plan.interval == 0:
            self._measure(iteration)
        if self.job is None:
            self._base(iteration)
        elif self._finished(iteration):
            self._record(self.job, self.features)
            self._next()
        self.pre = [p.detach().clone() for p in self.params]

    # ---- the base run ----------------------------------------------------------------------------
    def _base(self, iteration: int) -> None:
        plan = self.plan
        if iteration in plan.snapshots:
            self.snaps[iteration] = {"trainer": self.trainer.snapshot(), "series": list(self.series),
                                     "features": self._features(iteration)}
            self.log(f"[trigger] snapshot at step {iteration}: {self.snaps[iteration]['features']}")
        if iteration - plan.lag in plan.snapshots:
            self.base_features[iteration - plan.lag] = self._features(iteration)
        past = iteration >= max(plan.snapshots) + plan.lag
        if past and (not self.base_records or self._finished(iteration)):
            for s in self.base_records:
                self._record(Job(s, 0, CONTROL), self.base_features.get(s))
            self.base_records = []
            self._next()

    # ---- replays ---------------------------------------------------------------------------------
    def _next(self) -> None:
        if not self.queue:
            raise Done
        self.job = job = self.queue.pop(0)
        snap = self.snaps[job.snapshot]
        self.trainer.restore({**snap["trainer"], "consumed_samples":
                              snap["trainer"]["consumed_samples"] + job.replica * self.plan.offset})
        self.series, self.features, self.started = list(snap["series"]), None, time.monotonic()
        self.params = []
        if job.intervention == "eps1e-6":
            for group in self.optimizer.param_groups:
                group["eps"] = EPS
        elif job.intervention == "wo_lr0.1":
            self.params = [layer.attention.wo.weight for layer in self.module.layers[-self.plan.top_layers:]]
        elif job.intervention == "wo1_lr0.1":
            self.params = [self.module.layers[0].attention.wo.weight]
        elif job.intervention == "freeze_gains":
            self.params = [p for n, p in self.module.named_parameters() if n.endswith("norm.weight")]

    def _intervene(self) -> None:
        """Undo the part of the step just taken that the intervention forbids."""
        if not self.params:
            return
        with torch.no_grad():
            for p, before in zip(self.params, self.pre, strict=True):
                if self.job.intervention in ("wo_lr0.1", "wo1_lr0.1"):
                    p.copy_(before + WO_LR_FACTOR * (p - before))
                else:
                    p.copy_(before)

    # ---- measurements ----------------------------------------------------------------------------
    def _measure(self, iteration: int) -> None:
        last = self.metrics.last
        if last.get("step") != iteration:
            return
        rec = last["step_record"]
        self.series.append((iteration, rec["loss"], rec["t_sim_head"], rec["grad_ratio"]))
        if self.job is not None and iteration == self.job.snapshot + self.plan.lag:
            self.features = self._features(iteration)

    def _features(self, iteration: int) -> dict[str, Any] | None:
        """The regression's features at ``iteration`` (a measured step; None otherwise)."""
        last = self.metrics.last
        if last.get("step") != iteration:
            return None
        rec, layers = last["step_record"], last["layers"]
        resid = [r["resid_norm"] for r in layers if r["sublayer"] == "ffn"]
        amount = attention_amount(self.module, self.head_dim)
        first = self.module.layers[0]
        vs = [self.optimizer.state[p]["exp_avg_sq"].mean().item() for p in first.parameters()
              if p in self.optimizer.state and "exp_avg_sq" in self.optimizer.state[p]]
        tsim = rec["t_sim_head"]
        return {"step": iteration, "loss": rec["loss"], "t_sim_head": tsim, "grad_ratio": rec["grad_ratio"],
                "resid_deep": resid[-1] if resid else None, "resid": resid, "attn_s": amount,
                "attn_s_top": sum(amount[-self.plan.top_layers:]) / self.plan.top_layers,
                "one_minus_tsim": None if tsim is None else 1.0 - tsim,
                "adam_v_first": sum(vs) / len(vs) if vs else None}

    def _event(self) -> Any:
        steps, loss, tsim, ratio = (list(c) for c in zip(*self.series, strict=True))
        return from_series(steps, loss, tsim, ratio, self.freq_loss)

    def _finished(self, iteration: int) -> bool:
        if iteration >= self.plan.end_step:
            return True
        return iteration % CHECK_EVERY == 0 and len(self.series) > 1 and self._event().kind == DELAYED

    def _record(self, job: Job, features: dict[str, Any] | None) -> None:
        ev = self._event()
        snap = self.snaps[job.snapshot]
        rec = {"schema": SCHEMA, "version": VERSION, "snapshot": job.snapshot, "replica": job.replica,
               "intervention": job.intervention, "data_offset": job.replica * self.plan.offset,
               "window_start": snap["trainer"]["consumed_samples"] + job.replica * self.plan.offset,
               "end_step": self.plan.end_step, "last_step": self.series[-1][0], "event": ev.kind,
               "event_step": ev.step, "learned_step": ev.learned_step, "freq_loss": self.freq_loss,
               "final_loss": self.series[-1][1], "final_tsim": self.series[-1][2],
               "final_gap": final_gap([row[1] for row in self.series], self.freq_loss),
               "features": features or {}, "snapshot_features": snap["features"] or {},
               "seconds": round(time.monotonic() - self.started, 1)}
        append_record(self.out / "replicas.jsonl", rec)
        name = series_name(rec)
        own = self.series if name == "base" else [row for row in self.series if row[0] > job.snapshot]
        write_series(self.out / "series" / f"{name}.csv", own)
        self.plan.done.add(job)
        left = len(self.queue)
        self.log(f"[trigger] S {job.snapshot} r {job.replica} {job.intervention}: {ev.kind} "
                 f"{ev.step if ev.step is not None else ''} (last step {rec['last_step']}, "
                 f"{rec['seconds']:.0f} s); {left} replays left")


def append_record(path: Path, rec: dict[str, Any]) -> None:
    """Rewrite ``path`` with ``rec`` appended (atomically: a killed run leaves whole lines)."""
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    atomic_write_text(path, old + json.dumps(_clean(rec), allow_nan=False) + "\n")


def write_series(path: Path, rows: Sequence[tuple[int, Any, Any, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = lambda v: "" if v is None else f"{v:.6g}"  # noqa: E731
    atomic_write_text(path, "step,loss,t_sim_head,grad_ratio\n" + "".join(
        f"{s},{fmt(a)},{fmt(b)},{fmt(c)}\n" for s, a, b, c in rows))


def _clean(value: Any) -> Any:
    """Non-finite floats as null (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def metrics_plugin(trainer: Any) -> Any:
    found = [p for p in trainer.plugins if p.name == "collapse_metrics"]
    if not found:
        raise SystemExit("trigger: the run needs --plugins collapse_metrics")
    return found[0]


def run_plan(argv: Sequence[str], plan: Plan, out: Path, base_done: Callable[[int], bool]) -> None:
    """Build the trainer of ``argv`` and run ``plan`` in it (one process, one process group)."""
    from megapost.runtime.distributed import process_group_scope
    from megapost.train.build import build
    from megapost.train.prepare import prepare

    with process_group_scope():
        trainer = build(prepare(list(argv)))
        try:
            ctl = Controller(trainer, metrics_plugin(trainer), plan, out, base_done,
                             lambda line: print(line, flush=True))
            trainer.host.plugins.append(ctl)
            try:
                trainer.train()
            except Done:
                pass
        finally:
            trainer.close()
