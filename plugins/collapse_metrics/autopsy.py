"""``--collapse-autopsy K``: re-run the window around the first alarm / early warning, measuring everything.

While nothing has fired, the trainer's in-memory snapshot (as ``--collapse-guard`` keeps it) is taken every
K steps (the last two kept). On the first event (``--collapse-autopsy-on``) the run goes back to the
snapshot >= K steps before it and re-trains from there (exact: same batches, RNG, optimizer state), now
measuring every step up to event + ``--collapse-autopsy-after`` steps, and writing per step to
``<tensorboard-dir>/autopsy.jsonl``: the plugin's usual records (collapse_metrics.jsonl, every step) plus

  * per layer: update/weight ratio ||W_after - W_before|| / ||W_before|| of the optimizer step, Adam's
    second moment sqrt(v_hat) (mean, max), attention entropy per head (mean over queries and the probe
    batch, nats; log(position) is the uniform-causal maximum);
  * the largest eigenvalue of the Adam-preconditioned Hessian P^-1/2 H P^-1/2, P = diag(sqrt(v_hat) + eps),
    by ``--collapse-autopsy-power-iters`` power iterations of central-difference Hessian-vector products
    on the probe batch (every ``--collapse-autopsy-hessian-every`` steps), beside Adam's edge-of-stability
    threshold (2 + 2 beta1) / ((1 - beta1) lr) (Cohen et al. 2022);
  * the logit norm (mean over tokens), the norm of X^H and of the LM head weight.

The probe batch is the first micro-batch of the window's first step (fixed over the window). After the
window, training goes on with the usual interval (the trajectory is the one the run had). Exact for
ZeRO-0 fp32 without pipeline parallelism, one data-parallel rank (refused otherwise).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megapost.plugin_api import ConfigError, ModelView, PluginContext, RunInfo

from .config import CollapseConfig


def add_autopsy_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--collapse-autopsy", type=int, default=0, metavar="K",
                   help="on the first event re-run from >= K steps before it with every quantity every step "
                   "(autopsy.py; 0: off)")
    g.add_argument("--collapse-autopsy-on", choices=["early", "alarm"], default="early",
                   help="the event ('early' needs --collapse-early-warning)")
    g.add_argument("--collapse-autopsy-after", type=int, default=None, metavar="A",
                   help="steps measured after the event (default 2K)")
    g.add_argument("--collapse-autopsy-hessian-every", type=int, default=4, metavar="H")
    g.add_argument("--collapse-autopsy-power-iters", type=int, default=5, metavar="N")


def check_autopsy_args(flags: CollapseConfig, run: RunInfo, world: int) -> None:
    if not flags.collapse_autopsy:
        return
    if flags.collapse_autopsy < 1 or flags.collapse_autopsy_hessian_every < 1 or \
            flags.collapse_autopsy_power_iters < 1:
        raise ConfigError("--collapse-autopsy, --collapse-autopsy-hessian-every and "
                          "--collapse-autopsy-power-iters must be >= 1")
    if run.zero_stage != 0 or run.bf16 or world != 1:
        raise ConfigError("--collapse-autopsy: exact replay and the Hessian probe need one rank, "
                          "--zero-stage 0, fp32; drop --zero-stage/--bf16 or run on one process")
    if flags.collapse_guard:
        raise ConfigError("--collapse-autopsy and --collapse-guard both rewind the run: use one")
    if flags.collapse_autopsy_on == "early" and not flags.collapse_early_warning:
        raise ConfigError("--collapse-autopsy-on early needs --collapse-early-warning")


def _layer_of(name: str) -> str:
    parts = name.split(".")
    return f"layer{int(parts[parts.index('layers') + 1]) + 1}" if "layers" in parts else parts[0]


def attention_entropy(view: ModelView, model: torch.nn.Module,
                      tokens: torch.Tensor) -> tuple[list[list[float]], dict]:
    """Per layer, per head: the causal attention's entropy (nats) on ``tokens``, mean over the batch and
    the queries; plus norms of X^H, the logits and the LM head weight (one no-grad forward)."""
    probes = view.forward_probes(model, tokens)
    entropies = [(-(p * p.clamp_min(1e-30).log()).sum(-1)).mean(dim=(0, 2)).tolist()  # [b, h, s] -> h
                 for p in probes.attention]
    norms = {"xh_norm": float(probes.head_input.norm(dim=-1).mean()),
             "logit_norm": float(probes.logits.float().norm(dim=-1).mean()),
             "head_weight_norm": float(probes.head_weight.norm())}
    return entropies, norms


class Autopsy:
    def __init__(self, flags: CollapseConfig, out_dir: str | None) -> None:
        self.k = flags.collapse_autopsy
        self.hessian_every, self.power_iters = flags.collapse_autopsy_hessian_every, \
            flags.collapse_autopsy_power_iters
        self.after = flags.collapse_autopsy_after if flags.collapse_autopsy_after is not None else 2 * self.k
        self.on = flags.collapse_autopsy_on
        self.path = Path(out_dir) / "autopsy.jsonl" if out_dir else None
        self.snapshots: list[dict[str, Any]] = []
        self.event_step: int | None = None  # set when the event fired; the window ends at event + after
        self.window: tuple[int, int] | None = None
        self.probe: dict[str, torch.Tensor] | None = None
        self.before: dict[str, torch.Tensor] | None = None

    def dense(self, step: int) -> bool:
        return self.window is not None and self.window[0] < step <= self.window[1]

    def on_micro_batch(self, step: int, batch: dict[str, Any]) -> None:
        if self.dense(step) and self.probe is None:
            self.probe = {k: batch[k].detach().clone() for k in ("tokens", "labels")}

    def before_optimizer_step(self, step: int, model: torch.nn.Module) -> None:
        if self.dense(step):
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def after_iteration(self, iteration: int, ctx: PluginContext, model: torch.nn.Module, event: bool,
                        plugin_state: Any) -> str | None:
        """Snapshot / rewind on the event / measure in the window; returns a line to print, if any."""
        if self.window is None:
            if event:
                snap = self.snapshots[0]
                self.event_step = iteration
                self.window = (snap["trainer"]["iteration"], iteration + self.after)
                ctx.restore(snap["trainer"])
                plugin_state[1](copy.deepcopy(snap["plugin"]))
                return (f"[collapse] autopsy: event at step {iteration}; re-running steps "
                        f"{self.window[0] + 1}..{self.window[1]} with every quantity (autopsy.jsonl)")
            if not self.snapshots or iteration % self.k == 0:
                self.snapshots = [*self.snapshots[-1:], {"trainer": ctx.snapshot(),
                                                         "plugin": copy.deepcopy(plugin_state[0]())}]
            return None
        if self.dense(iteration):
            self._measure(iteration, model, ctx)
        return None

    def _measure(self, step: int, model: torch.nn.Module, ctx: PluginContext) -> None:
        rec: dict[str, Any] = {"step": step, "event_step": self.event_step, "lr": ctx.lr()}
        upd: dict[str, list[float]] = {}
        for n, p in model.named_parameters():
            if self.before is not None and n in self.before:
                w = upd.setdefault(_layer_of(n), [0.0, 0.0])
                w[0] += float((p.detach() - self.before[n]).pow(2).sum())
                w[1] += float(self.before[n].pow(2).sum())
        rec["update_ratio"] = {k: math.sqrt(a / b) if b else None for k, (a, b) in upd.items()}
        rec["adam_v"] = self._second_moments(model, ctx)
        tokens = self.probe["tokens"].to(next(model.parameters()).device)
        ent, norms = attention_entropy(ctx.services.model, model, tokens)
        rec["attn_entropy"] = ent
        rec.update(norms)
        if (step - self.window[0]) % self.hessian_every == 1 % self.hessian_every:
            rec["sharpness_precond"] = self._sharpness(model, ctx)
            beta1 = ctx.optimizer_hyperparameters()["betas"][0]
            rec["eos_threshold"] = (2 + 2 * beta1) / ((1 - beta1) * rec["lr"]) if rec["lr"] else None
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def _vhat(self, model: torch.nn.Module, ctx: PluginContext) -> dict[str, torch.Tensor]:
        beta2 = ctx.optimizer_hyperparameters()["betas"][1]
        out = {}
        for n, p in model.named_parameters():
            st = ctx.optimizer_state(p)
            if "exp_avg_sq" in st:
                t = float(st["step"]) if "step" in st else 1.0
                out[n] = st["exp_avg_sq"] / (1 - beta2 ** max(t, 1.0))
        return out

    def _second_moments(self, model: torch.nn.Module, ctx: PluginContext) -> dict[str, list[float]]:
        acc: dict[str, list[float]] = {}
        for n, v in self._vhat(model, ctx).items():
            s = v.sqrt()
            a = acc.setdefault(_layer_of(n), [0.0, 0, 0.0])
            a[0], a[1], a[2] = a[0] + float(s.sum()), a[1] + s.numel(), max(a[2], float(s.max()))
        return {k: [a[0] / a[1], a[2]] for k, a in acc.items()}

    def _sharpness(self, model: torch.nn.Module, ctx: PluginContext) -> float:
        """lambda_max(P^-1/2 H P^-1/2) by power iteration; H v by central differences of the gradient."""
        params = [p for p in model.parameters() if p.requires_grad]
        names = {id(p): n for n, p in model.named_parameters()}
        vhat, eps = self._vhat(model, ctx), ctx.optimizer_hyperparameters()["eps"]
        pinv = [1.0 / (vhat[names[id(p)]].sqrt() + eps).sqrt() if names[id(p)] in vhat
                else torch.ones_like(p) for p in params]
        saved = [p.detach().clone() for p in params]
        device = params[0].device
        tokens, labels = self.probe["tokens"].to(device), self.probe["labels"].to(device)

        def grad_at(shift: list[torch.Tensor], h: float) -> list[torch.Tensor]:
            with torch.no_grad():
                for p, s0, d in zip(params, saved, shift, strict=True):
                    p.copy_(s0 + h * d)
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            return list(torch.autograd.grad(loss, params))

        gen = torch.Generator(device="cpu").manual_seed(0)
        u = [torch.randn(p.shape, generator=gen).to(device) for p in params]
        lam = math.nan
        try:
            for _ in range(self.power_iters):
                norm = math.sqrt(sum(float(x.pow(2).sum()) for x in u))
                u = [x / norm for x in u]
                d = [x * q for x, q in zip(u, pinv, strict=True)]  # P^-1/2 u
                h = 1e-3 * math.sqrt(sum(float(s.pow(2).sum()) for s in saved)) / \
                    max(1e-12, math.sqrt(sum(float(x.pow(2).sum()) for x in d)))
                gp, gm = grad_at(d, h), grad_at(d, -h)
                hv = [(a - b) / (2 * h) * q for a, b, q in zip(gp, gm, pinv, strict=True)]
                lam = sum(float((a * b).sum()) for a, b in zip(u, hv, strict=True))
                u = hv
        finally:
            with torch.no_grad():
                for p, s0 in zip(params, saved, strict=True):
                    p.copy_(s0)
        return lam
