"""Helpers for the collapse-metrics tests: build the plugin, drive its hooks in the trainer's order, and
compute every quantity explicitly from a manual forward that replicates the block dataflow."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from collapse_metrics.plugin import CollapseMetricsPlugin

from megapost.config.resolved import plugin_config
from megapost.model import LlamaModel, ModelConfig, lm_loss
from megapost.model.norm import DyT, RMSNorm
from megapost.optim import accessors
from megapost.parallel.state import ParallelState
from megapost.plugin_api import PluginContext, RunInfo
from megapost.train.plugin_binding import bind_plugins
from megapost.train.plugin_services import model_services

Batch = dict[str, torch.Tensor]


def small_config(norm_position: str = "post", **overrides: Any) -> ModelConfig:
    base = dict(vocab_size=40, num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                seq_length=12, norm_position=norm_position, init_method_std=0.1, seed=5)
    return ModelConfig(**{**base, **overrides})


def plugin_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    CollapseMetricsPlugin.add_arguments(parser)
    return parser.parse_args(list(argv))


def collapse_config(*argv: str) -> Any:
    """The plugin's own typed config of ``argv`` (its flags only), as megapost builds it."""
    return plugin_config(CollapseMetricsPlugin, plugin_args(*argv))


def run_info(cfg: ModelConfig, **run: Any) -> RunInfo:
    """What the plugin knows of a run of ``cfg`` (``run``: train_iters, lr, zero_stage, ...)."""
    return RunInfo(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                   norm_position=cfg.norm_position, seq_length=cfg.seq_length, **run)


def make_plugin(cfg: ModelConfig, *argv: str, pstate: ParallelState | None = None, tb_dir: str | None = None,
                writer: Any = None) -> CollapseMetricsPlugin:
    ctx = PluginContext(config=collapse_config(*argv), run=run_info(cfg), parallel=pstate or ParallelState(),
                        services=model_services(cfg), tensorboard_dir=tb_dir, writer=writer)
    return CollapseMetricsPlugin(ctx)


class TorchEngine:
    """What the plugin reads of an Engine, for a plain torch model standing in for it on these ranks: its
    module and the owned gradient (megapost.optim.accessors' rule: TP shards everywhere, replicas on TP
    rank 0, a full data-parallel-reduced ``.grad`` on DP rank 0)."""

    def __init__(self, module: torch.nn.Module, pstate: Any) -> None:
        self.module, self.pstate = module, pstate

    def owned_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return accessors.owned_grad(param, self.pstate.tp_rank, self.pstate.dp_rank)


def random_batches(cfg: ModelConfig, num: int, batch: int = 2, seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=gen)
        mask = torch.ones(batch, cfg.seq_length)
        out.append({"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask})
    return out


def run_step(plugin: CollapseMetricsPlugin, model: torch.nn.Module, step: int, batches: Sequence[Batch],
             optimizer: torch.optim.Optimizer | None = None,
             forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
             on_grads: Callable[[], None] | None = None,
             loss_fn: Callable[..., torch.Tensor] = lm_loss) -> float:
    """One optimizer step with the hooks called as the trainer does (plain torch; the model stands in
    for the engine: ``before_optimizer_step`` reads its parameters' ``.grad``). With ``optimizer=None``
    it is a forward-only step (as at step 0). ``on_grads`` runs once the gradients are complete, before
    the plugin and the optimizer see them (to record them, or to average them over data-parallel ranks)."""
    forward = forward or model
    wanted = plugin.wants_step(step)
    if wanted:
        plugin.on_step_begin(step, model)
    losses = []
    with torch.set_grad_enabled(optimizer is not None):
        for batch in batches:
            if wanted:
                plugin.on_micro_batch(step, batch)
            loss = loss_fn(forward(batch["tokens"]), batch["labels"], batch["loss_mask"])
            if optimizer is not None:
                (loss / len(batches)).backward()
            losses.append(float(loss.detach()))
    if optimizer is not None:
        if on_grads is not None:
            on_grads()
        if wanted:
            if plugin.ctx.trainer is None:  # the trainer binds it; here the plain model stands in
                bind_plugins([plugin], TorchEngine(model, plugin.ctx.parallel))
            plugin.before_optimizer_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mean = sum(losses) / len(losses)
    if wanted:
        plugin.on_step_end(step, mean)
    return mean


# ---- explicit reference ----------------------------------------------------------------------------
def sublayer_form(cfg: ModelConfig, layer: int, k: int) -> str:
    """The paper's form of sublayer k (0 attention, 1 FFN) of 1-based ``layer`` (docs/placements.md),
    written from the papers, independently of megapost.model.placements."""
    p = cfg.norm_position
    if p == "mix":  # Mix-LN: Post-Norm in layers 1..floor(rho L), Pre-Norm after
        return "post" if layer <= math.floor(cfg.mix_post_fraction * cfg.num_layers + 1e-9) else "pre"
    if p == "hybrid":  # HybridNorm: QKV-normed attention, then a Post-Norm; FFN without a norm
        return ("hybrid-attn", "plain")[k]
    return p


def expects_final_norm(cfg: ModelConfig) -> bool:
    """A final norm unless the last sublayer normalises its residual sum (post, deepnorm, all-Post mix)."""
    return sublayer_form(cfg, cfg.num_layers, 1) not in ("post", "deepnorm")


def manual_forward(model: LlamaModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[Any, dict]]:
    """Logits and every intermediate of the block dataflow, retained: X_k, Y_k, the normalised output
    ``out`` (None unless the stream is normalised after the add) and ``u``, the input of the sublayer's
    residual-stream RMSNorm (None without one: hybrid's FFN, every DyT sublayer). F, N are the block's
    own attention / FFN / norm modules; the dataflow around them is the papers' (docs/placements.md)."""
    cfg = model.config
    acts: dict[Any, dict] = {}
    x = model.embedding.word_embeddings(tokens)
    if cfg.norm_position == "dyt":  # DyT's LLaMA: embedding times a learned scalar
        x = x * model.embedding.scale
    acts["embed"] = {"x": x}
    for block in model.layers:
        l = block.layer_number  # noqa: E741
        sublayers = ((block.attention, block.attention_norm, block.attention_out_norm),
                     (block.mlp, block.mlp_norm, block.mlp_out_norm))
        for k, (fn, norm, out_norm) in enumerate(sublayers):
            form, out = sublayer_form(cfg, l, k), None
            if form in ("post", "hybrid-attn"):  # Y = X + F(X); out = N(Y)
                y = x + fn(x)
                out, u = norm(y), y
            elif form == "deepnorm":  # out = N(alpha X + F(X)), alpha = (2L)^(1/4)
                y = (2.0 * cfg.num_layers) ** 0.25 * x + fn(x)
                out, u = norm(y), y
            elif form in ("pre", "dyt"):  # Y = X + F(N(X))
                y, u = x + fn(norm(x)), x
            elif form == "pre-scaled":  # Y = X + F(N(X) / sqrt(l))
                y, u = x + fn(norm(x) / math.sqrt(l)), x
            elif form == "sandwich":  # Y = X + N_out(F(N_in(X)))
                y, u = x + out_norm(fn(norm(x))), x
            elif form == "plain":  # Y = X + F(X)
                y, u = x + fn(x), None
            else:
                raise AssertionError(form)
            if cfg.norm_position == "dyt":
                u = None  # no RMS factor: DyT is not an RMS normalisation
            acts[(l, k)] = {"x": x, "y": y, "out": out, "u": u}
            x = y if out is None else out
    assert (model.head.final_norm is not None) == expects_final_norm(cfg)
    if model.head.final_norm is not None:
        x = model.head.final_norm(x)
    acts["head"] = {"x": x}
    return model.head.lm_head(x), acts


def explicit_tsim(x: torch.Tensor) -> torch.Tensor:
    """||Pi X||_F^2 / ||X||_F^2 per sequence with Pi = 11^T/n as a matrix (float64)."""
    x = x.detach().double()
    n = x.shape[1]
    pi = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    return torch.stack([(pi @ s).square().sum() / s.square().sum() for s in x])


def reference(model: LlamaModel, batches: Sequence[Batch],
              loss_fn: Callable[..., torch.Tensor] = lm_loss) -> dict[str, Any]:
    """Expected metrics of one step on ``batches`` (means over all sequences/tokens, pooled alpha)."""
    d = model.config.hidden_size
    acc: dict[Any, dict[str, list]] = {}
    sq: dict[Any, list[float]] = {}
    for batch in batches:
        logits, acts = manual_forward(model, batch["tokens"])
        loss = loss_fn(logits, batch["labels"], batch["loss_mask"]) / len(batches)
        keys = [key for key in acts if isinstance(key, tuple)]
        inputs = [acts[key][t] for key in keys for t in ("x", "y")]
        needed = [t for t in inputs if t.requires_grad]
        found = dict(zip(map(id, needed), torch.autograd.grad(loss, needed), strict=True))
        grads = [found.get(id(t)) for t in inputs]
        for i, key in enumerate(keys):
            gx, gy = grads[2 * i], grads[2 * i + 1]
            s = sq.setdefault(key, [0.0, 0.0])
            s[0] += float(gx.double().square().sum()) if gx is not None else math.nan
            s[1] += float(gy.double().square().sum())
        for key, tensors in acts.items():
            entry = acc.setdefault(key, {})
            for name, t in tensors.items():
                if t is None:
                    continue
                t = t.detach().double()
                entry.setdefault(f"t_{name}", []).append(explicit_tsim(t))
                entry.setdefault(f"norm_{name}", []).append(t.norm(dim=-1).flatten())
    out: dict[str, Any] = {}
    for key, entry in acc.items():
        cat = {name: torch.cat(v) for name, v in entry.items()}
        if not isinstance(key, tuple):
            out[key] = float(cat["t_x"].mean())
            continue
        rms = math.sqrt(d) / cat["norm_u"] if "norm_u" in cat else None
        alpha = math.sqrt(sq[key][0] / sq[key][1])
        out[key] = {
            "t_sim_x": float(cat["t_x"].mean()), "t_sim_y": float(cat["t_y"].mean()),
            "t_sim_out": float(cat["t_out"].mean()) if "t_out" in cat else None,
            "resid_norm": float(cat["norm_y"].mean()),
            "rms_factor_mean": None if rms is None else float(rms.mean()),
            "rms_factor_min": None if rms is None else float(rms.min()),
            "rms_factor_max": None if rms is None else float(rms.max()),
            "alpha": alpha, "c": None if rms is None else alpha * float(rms.mean()),
        }
    return out


def grad_norms(model: LlamaModel) -> dict[int, dict[str, float]]:
    """Per-layer ||grad|| of all, attention, FFN and norm parameters from ``.grad`` (call before step).
    Norms: the parameters of every RMSNorm / DyT module of the block (found by type, not by name)."""
    out = {}
    for block in model.layers:
        groups: dict[str, float] = {"attn": 0.0, "ffn": 0.0, "norms": 0.0}
        for mod_name, module in block.named_modules():
            for p in module.parameters(recurse=False):
                if isinstance(module, RMSNorm | DyT):
                    key = "norms"
                else:
                    key = {"attention": "attn", "mlp": "ffn"}[mod_name.split(".")[0]]
                groups[key] += float(p.grad.double().square().sum())
        out[block.layer_number] = {k: math.sqrt(v) for k, v in groups.items()} | {
            "layer": math.sqrt(sum(groups.values()))}
    return out


def records_by_key(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["layer"], ("attn", "ffn").index(r["sublayer"])): r for r in records}


def assert_close(actual: float | None, expected: float | None, rel: float, what: str) -> None:
    if expected is None or actual is None:
        assert actual is expected, f"{what}: {actual} vs {expected}"
        return
    assert abs(actual - expected) <= rel * max(abs(expected), 1e-12), f"{what}: {actual} vs {expected}"
