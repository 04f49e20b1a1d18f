"""Figures of the study (matplotlib without pyplot; every PNG written atomically).

Stage I (Figs 1, 2) from the JSON of collapse_metrics.analysis.stage1; training-run figures (Figs 3-6 and a
t_sim heatmap) from a run's ``collapse_metrics.jsonl`` (read by ``runs.load_collapse_jsonl``,
which imports no matplotlib).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from megapost.plugin_api import atomic_path

from .runs import CollapseRun, load_collapse_jsonl, placement_label, sub_table

CMAP = "viridis"
SUBLAYER_TITLES = {"attn": "attention", "ffn": "FFN"}


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    return Path(path)


def _colours(values: Sequence[float], log: bool = False) -> tuple[list[Any], ScalarMappable]:
    vals = np.asarray(values, dtype=np.float64)
    lo, hi = float(np.min(vals)), float(np.max(vals))
    norm = LogNorm(lo, hi) if log and lo > 0 and hi > lo else Normalize(lo, hi if hi > lo else lo + 1)
    sm = ScalarMappable(norm=norm, cmap=colormaps[CMAP])
    return [sm.to_rgba(v) for v in vals], sm


def _no_data(ax: Axes, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="grey")


# ------------------------------------------------------------------------------------------- Stage I
def _style_legend(ax: Axes, extra: Sequence[tuple[str, str]]) -> None:
    handles = [Line2D([], [], color="k", ls=ls, label=label) for ls, label in extra]
    ax.legend(handles=handles, fontsize=7, loc="best")


def plot_init_similarity(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Fig 1: measured (solid) vs predicted (dashed) one-step increments per layer, one colour per
    multiplier; Post-Norm's norm step dotted; right panel t_sim(X_1^l) measured vs iterated prediction."""
    runs = result["runs"]
    # the norm step t(N(Y)) - t(Y) exists where a sublayer normalises its residual sum (post-style rules)
    post = any(np.isfinite(np.asarray(r["measured"]["mean"][f"{sub}_norm"], dtype=float)).any()
               for r in runs for sub in ("attn", "ffn"))
    theory = all(r["predicted"] is not None for r in runs)
    colours, _ = _colours([r["multiplier"] for r in runs], log=True)
    fig = Figure(layout="constrained", figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for run, col in zip(runs, colours, strict=True):
        mean, pred = run["measured"]["mean"], run["predicted"]
        layers = np.arange(1, len(mean["attn_resid"]) + 1)
        label = f"σ² × {run['multiplier']:g}"
        for ax, sub in zip(axes[:2], ("attn", "ffn"), strict=True):
            ax.plot(layers, mean[f"{sub}_resid"], color=col, lw=1.5, label=label)
            if pred is not None:
                ax.plot(layers, pred["mean"][sub], color=col, ls="--", lw=1.2)
            if post:
                ax.plot(layers, np.asarray(mean[f"{sub}_norm"], dtype=float), color=col, ls=":", lw=1.0)
        t_meas = np.nanmean(np.asarray(run["measured"]["attn"]["t_x"], dtype=float), axis=0)
        axes[2].plot(layers, t_meas, color=col, lw=1.5, label=label)
        if pred is not None:
            axes[2].plot(layers, pred["iterated"]["t_attn"], color=col, ls="--", lw=1.2)
    styles = [("-", "measured t(Y)−t(X)")]
    styles += [("--", "theory at measured t(X)")] if theory else []
    styles += [(":", "norm step t(N(Y))−t(Y)")] if post else []
    for ax, sub in zip(axes[:2], ("attn", "ffn"), strict=True):
        ax.set(title=f"{SUBLAYER_TITLES[sub]} sublayer", xlabel="layer l", ylabel="one-step Δ t_sim")
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    _style_legend(axes[1], styles)
    axes[0].legend(fontsize=7, loc="best")
    axes[2].set(title="t_sim(X₁ˡ) entering attention", xlabel="layer l", ylabel="t_sim")
    axes[2].set_ylim(bottom=0)
    axes[2].grid(alpha=0.3)
    _style_legend(axes[2], [("-", "measured")] + ([("--", "iterated prediction")] if theory else []))
    cfg = result["config"]
    no_theory = "" if theory else " (no closed form for this placement: measured only)"
    fig.suptitle(f"{placement_label(cfg['norm_position'], cfg.get('qk_norm', False))} at initialisation: "
                 f"{cfg['num_layers']} layers, d={cfg['hidden_size']}, n={cfg['seq_length']}, "
                 f"{result['num_sequences']} sequence(s){no_theory}")
    return save(fig, path)


def alpha_label(alpha: float, share: float | None) -> str:
    """Legend entry of one alpha: the share of the attention increment it removes (or adds)."""
    if share is None:
        return f"α={alpha:g}"
    what = f"removes {100 * share:.1f}%" if share >= 0 else f"adds {-100 * share:.1f}%"
    return f"α={alpha:g} ({what})"


def plot_prefix_alpha(results: dict[str, dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Fig 2: measured attention increments per layer for each alpha (one column per placement); the
    bottom row shows t_sim(X_1^l) for the same runs."""
    cols = [(k, v) for k, v in results.items() if v.get("prefix_alpha_sweep")]
    fig = Figure(layout="constrained", figsize=(6.5 * max(1, len(cols)), 7.5))
    axes = np.asarray(fig.subplots(2, max(1, len(cols)), squeeze=False))
    for j, (norm, res) in enumerate(cols):
        sweep = res["prefix_alpha_sweep"]
        colours, sm = _colours([r["prefix_alpha"] for r in sweep])
        removed = res.get("prefix_alpha_removed", {})
        for run, col in zip(sweep, colours, strict=True):
            inc = run["measured"]["mean"]["attn_resid"]
            layers = np.arange(1, len(inc) + 1)
            share = removed.get(f"{run['prefix_alpha']:g}")
            label = alpha_label(run["prefix_alpha"], share)
            axes[0, j].plot(layers, inc, color=col, lw=1.5, label=label)
            if run["predicted"] is not None:
                axes[0, j].plot(layers, run["predicted"]["mean"]["attn"], color=col, ls="--", lw=1.0)
            t = np.nanmean(np.asarray(run["measured"]["attn"]["t_x"], dtype=float), axis=0)
            axes[1, j].plot(layers, t, color=col, lw=1.5)
        dashed = " (dashed: Cor. 3.3)" if all(r["predicted"] is not None for r in sweep) else ""
        title = f"{placement_label(norm)}: attention Δ t_sim, P → P − α Cₙ{dashed}"
        axes[0, j].set(title=title, xlabel="layer l", ylabel="measured t(Y₁)−t(X₁)")
        axes[0, j].legend(fontsize=7)
        axes[0, j].axhline(0.0, color="grey", lw=0.5)
        axes[1, j].set(title="t_sim(X₁ˡ)", xlabel="layer l", ylabel="t_sim")
        axes[1, j].set_ylim(bottom=0)
        fig.colorbar(sm, ax=axes[:, j], label="α")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    if not cols:
        _no_data(axes[0, 0], "no prefix-alpha sweep")
    return save(fig, path)


def _per_layer_lines(ax: Axes, x: np.ndarray, values: np.ndarray, layers: np.ndarray, log: bool = False,
                     mask: np.ndarray | None = None) -> bool:
    """One line per layer (colour = layer); returns whether anything was drawn."""
    keep = np.ones(len(x), dtype=bool) if mask is None else mask
    colours, _ = _colours(layers if len(layers) else [1])
    drawn = False
    for j, col in enumerate(colours[: values.shape[1] if values.ndim == 2 else 0]):
        y = values[keep, j]
        ok = ~np.isnan(y) & ((y > 0) if log else True)
        if ok.any():
            ax.plot(x[keep][ok], y[ok], color=col, lw=1.0)
            drawn = True
    if log and drawn:
        ax.set_yscale("log")
    if not drawn:
        _no_data(ax)
    return drawn


def _layer_colorbar(fig: Figure, run: CollapseRun, axes: Any) -> None:
    if len(run.layers):
        fig.colorbar(_colours(run.layers)[1], ax=axes, label="layer l")


def fig_alpha(run: CollapseRun) -> Figure:
    """Fig 3: alpha_k^l = ||dL/dX_k|| / ||dL/dY_k|| over all steps, attention and FFN."""
    fig = Figure(layout="constrained", figsize=(13, 4.2))
    axes = fig.subplots(1, 2)
    for ax, sub in zip(axes, SUBLAYER_TITLES, strict=True):
        # log scale: one layer's alpha may dwarf the rest by decades (the collapsed toy)
        _per_layer_lines(ax, run.layer_steps, sub_table(run, sub, "alpha"), run.layers, log=True)
        ax.set(title=f"α (gradient contribution), {SUBLAYER_TITLES[sub]}", xlabel="step", ylabel="α_k^l")
        ax.grid(alpha=0.3, which="both")
    _layer_colorbar(fig, run, axes)
    return fig


def fig_contraction(run: CollapseRun, window: tuple[float, float]) -> Figure:
    """Fig 4: sqrt(d)/||y|| (a, c) and c = alpha sqrt(d)/||y|| (b, d) over the transition window."""
    fig = Figure(layout="constrained", figsize=(13, 8))
    axes = fig.subplots(2, 2)
    mask = (run.layer_steps >= window[0]) & (run.layer_steps <= window[1])
    panels = [("attn", "rms_factor_mean", "√d/‖y‖"), ("attn", "c", "c(y, α)"),
              ("ffn", "rms_factor_mean", "√d/‖y‖"), ("ffn", "c", "c(y, α)")]
    for ax, (sub, field, ylabel), letter in zip(axes.flat, panels, "abcd", strict=True):
        _per_layer_lines(ax, run.layer_steps, sub_table(run, sub, field), run.layers, log=True, mask=mask)
        if field == "c":
            ax.axhline(1.0, color="red", lw=0.8, ls="--", label="c = 1 (below: the gradient shrinks)")
            ax.legend(fontsize=7, loc="best")
        ax.set(title=f"({letter}) {ylabel}, {SUBLAYER_TITLES[sub]}", xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3, which="both")
    _layer_colorbar(fig, run, axes)
    fig.suptitle(f"steps {window[0]:g}–{window[1]:g}")
    return fig


def fig_grad_norms(run: CollapseRun, window: tuple[float, float]) -> Figure:
    """Fig 5: per-layer gradient norms (log): vs layer, one line per step; and vs step, one line per layer."""
    fig = Figure(layout="constrained", figsize=(13, 4.5))
    axes = fig.subplots(1, 2)
    grads = run.layer_grad()
    mask = (run.layer_steps >= window[0]) & (run.layer_steps <= window[1])
    steps = run.layer_steps[mask]
    drawn = False
    if len(steps):
        colours, sm = _colours(steps)
        for row, col in zip(grads[mask], colours, strict=True):
            ok = ~np.isnan(row) & (row > 0)
            if ok.any():
                axes[0].plot(run.layers[ok], row[ok], color=col, lw=1.0, marker=".", ms=3)
                drawn = True
        fig.colorbar(sm, ax=axes[0], label="step")
    if drawn:
        axes[0].set_yscale("log")
    else:
        _no_data(axes[0])
    axes[0].set(title="layer gradient norm ‖∇W‖ per step", xlabel="layer l", ylabel="‖∇W‖_F")
    _per_layer_lines(axes[1], run.layer_steps, grads, run.layers, log=True, mask=mask)
    axes[1].set(title="layer gradient norm over steps", xlabel="step", ylabel="‖∇W‖_F")
    _layer_colorbar(fig, run, axes[1])
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"steps {window[0]:g}–{window[1]:g}")
    return fig


def fig_loss(run: CollapseRun, window: tuple[float, float],
             references: dict[str, float] | None = None) -> Figure:
    """Fig 6: training loss against the frequency-loss references (the step's batch, aggregated and per
    sequence; the running aggregate of the labels seen; ``references``: fixed values such as a token
    budget's, drawn as horizontal lines), transition window shaded."""
    fig = Figure(layout="constrained", figsize=(8, 4.5))
    ax = fig.subplots()
    lines = [("loss", "training loss", "k", "-"),
             ("freq_loss_agg", "frequency loss: step's batch, aggregated", "C3", "--"),
             ("freq_loss_seq", "frequency loss: step's batch, per sequence", "C1", ":"),
             ("freq_loss_running", "frequency loss: labels seen so far", "C2", "-."),
             ("freq_loss_corpus", "frequency loss: the train split", "C5", "--")]
    drawn = False
    for field, label, col, ls in lines:
        y = run.step[field]
        ok = ~np.isnan(y)
        if ok.any():
            ax.plot(run.steps[ok], y[ok], color=col, ls=ls, lw=1.3, label=label)
            drawn = True
    for i, (label, value) in enumerate((references or {}).items()):
        ax.axhline(value, color=f"C{4 + i}", ls="--", lw=1.0, label=f"{label}: {value:.3f}")
        drawn = True
    if np.nan_to_num(run.step["transition"]).any():
        ax.axvspan(*window, color="orange", alpha=0.15, label="transition window")
    if drawn:
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set(title="loss vs frequency loss (Thm 3.8)", xlabel="step", ylabel="nats")
    ax.grid(alpha=0.3)
    return fig


def fig_tsim_heatmap(run: CollapseRun) -> Figure:
    """t_sim of each layer's output (Post-Norm: after its last RMSNorm) over steps, with the last layer's
    and the head input's t_sim above."""
    fig = Figure(layout="constrained", figsize=(11, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 2.2])
    out = sub_table(run, "ffn", "t_sim_out")
    grid = np.where(np.isnan(out), sub_table(run, "ffn", "t_sim_y"), out)
    if grid.size and not np.all(np.isnan(grid)):
        x = run.layer_steps.astype(float)
        edges = np.concatenate([x, [x[-1] + (x[-1] - x[-2] if len(x) > 1 else 1)]])
        lay = np.concatenate([run.layers, [run.layers[-1] + 1]]) - 0.5
        mesh = bottom.pcolormesh(edges, lay, grid.T, cmap="magma", vmin=0, vmax=1, shading="flat")
        fig.colorbar(mesh, ax=[top, bottom], label="t_sim", shrink=0.6, anchor=(0.0, 0.0))
        top.plot(x, grid[:, -1], color="k", lw=1.2, label=f"layer {run.layers[-1]} output")
    else:
        _no_data(bottom)
    head = run.step["t_sim_head"]
    if (~np.isnan(head)).any():
        top.plot(run.steps[~np.isnan(head)], head[~np.isnan(head)], color="C3", ls="--", lw=1.0,
                 label="head input")
    top.set(ylabel="t_sim", ylim=(0, 1.02), title="token similarity over training")
    if top.get_legend_handles_labels()[0]:
        top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set(xlabel="step", ylabel="layer l")
    return fig


def plot_collapse_run(jsonl: str | os.PathLike[str], out_dir: str | os.PathLike[str], margin: int = 50,
                      references: dict[str, float] | None = None) -> dict[str, Path]:
    """All training-run figures of one run; returns {name: png path}."""
    run = load_collapse_jsonl(jsonl)
    window = run.window(margin)
    makers: dict[str, Callable[[], Figure]] = {
        "fig3_alpha": lambda: fig_alpha(run),
        "fig4_contraction": lambda: fig_contraction(run, window),
        "fig5_grad_norms": lambda: fig_grad_norms(run, window),
        "fig6_loss_vs_frequency": lambda: fig_loss(run, window, references),
        "tsim_heatmap": lambda: fig_tsim_heatmap(run),
    }
    return {name: save(_titled(make(), run.norm_label), Path(out_dir) / f"{name}.png")
            for name, make in makers.items()}


def _titled(fig: Figure, norm_label: str) -> Figure:
    """Put the norm placement in front of the figure's super-title."""
    old = fig.get_suptitle()
    fig.suptitle(f"{norm_label}: {old}" if old else norm_label)
    return fig
