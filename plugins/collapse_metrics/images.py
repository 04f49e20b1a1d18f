"""Every measured layer at once, as TensorBoard images (IMAGES tab), readable at 48-96 layers:
    collapse/depth_profiles   each quantity against the layer index, at the first, a middle and the
                              latest measured step (attn solid, ffn dashed)
    collapse/heatmaps         each quantity as layer x measured step (rows: layers, and their attn/ffn
                              sublayers in depth order); the step the collapse alarm went on is marked
Quantities: t_sim of the layer output, the RMSNorm factor sqrt(d)/||u||, alpha, c = alpha x factor, the
layer's parameter-gradient norm and the residual norm mean_i ||y_i|| (all but t_sim on a log scale).
Drawn headless (matplotlib Agg) by the logging rank every image interval and at the end.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from .table import SUBLAYERS
from .tb_layout import layer_output

TITLE_PT, TICK_PT = 11, 10  # text sizes in a 9-inch figure: readable in TensorBoard's ~500 px card
# title, JSONL field (None: the layer output's t_sim), per sublayer?, log scale?
QUANTITIES = (("t_sim of the layer output", None, False, False),
              ("RMSNorm factor sqrt(d)/||u||", "rms_factor_mean", True, True),
              ("alpha = ||dL/dX|| / ||dL/dY||", "alpha", True, True),
              ("c = alpha x RMS factor", "c", True, True),
              ("parameter-gradient norm of the layer", "grad_norm_layer", False, True),
              ("residual norm mean ||y||", "resid_norm", True, True))


def _value(rec: dict[str, Any] | None, field: str | None) -> float:
    value = None if rec is None else (layer_output(rec) if field is None else rec[field])
    return np.nan if value is None else float(value)


def _spans_decades(values: np.ndarray) -> bool:
    """Log scale only where the positive values span more than a factor of 20."""
    positive = values[np.isfinite(values) & (values > 0)]
    return positive.size > 0 and positive.max() > 20 * positive.min()


def _grid() -> tuple[Any, Any]:
    """A 2 x 3 figure, off pyplot (no GUI backend, nothing to close). Small in inches, so its text is
    large beside the panels: TensorBoard's card shows it scaled to ~500 px and it still reads there."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.4), dpi=100)
    axes = fig.subplots(2, 3).ravel()
    fig.subplots_adjust(left=0.06, right=0.97, bottom=0.09, top=0.9, wspace=0.45, hspace=0.5)
    for ax in axes:
        ax.tick_params(labelsize=TICK_PT)
    return fig, axes


class DepthImages:
    """The measured steps' per-layer values (the last ``max_steps``), drawn as profiles and heatmaps."""

    def __init__(self, layers: tuple[int, ...], max_steps: int = 2000) -> None:
        self.layers = layers
        self.steps: deque[int] = deque(maxlen=max_steps)
        self.columns: deque[list[np.ndarray]] = deque(maxlen=max_steps)  # per quantity: [rows]

    def copy(self) -> DepthImages:
        """The values so far, frozen (a figure drawn from it does not see later steps)."""
        other = DepthImages(self.layers, self.steps.maxlen or 2000)
        other.steps.extend(self.steps)
        other.columns.extend(self.columns)
        return other

    def add(self, step: int, records: list[dict[str, Any]]) -> None:
        by = {(r["layer"], r["sublayer"]): r for r in records}
        col = []
        for _, field, per_sub, _ in QUANTITIES:
            keys = [(n, k) for n in self.layers for k in SUBLAYERS] if per_sub else \
                   [(n, SUBLAYERS[-1] if field is None else SUBLAYERS[0]) for n in self.layers]
            col.append(np.array([_value(by.get(key), field) for key in keys], dtype=np.float64))
        self.steps.append(step)
        self.columns.append(col)

    def _sizes(self) -> list[int]:
        """Rows per quantity in a column (per-sublayer quantities have a row per sublayer)."""
        return [len(self.layers) * (len(SUBLAYERS) if per_sub else 1) for _, _, per_sub, _ in QUANTITIES]

    def state_dict(self) -> dict[str, Any]:
        """The history as one [steps, rows] float64 tensor (a checkpoint stores it as a tensor)."""
        flat = [np.concatenate(col) for col in self.columns]
        return {"layers": list(self.layers), "steps": list(self.steps),
                "columns": torch.from_numpy(np.stack(flat)) if flat else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved history; none when the measured layers changed (--collapse-layers)."""
        self.steps.clear()
        self.columns.clear()
        if tuple(state["layers"]) != tuple(self.layers) or state["columns"] is None:
            return
        cuts = np.cumsum(self._sizes())[:-1]
        for step, row in zip(state["steps"], np.asarray(state["columns"], dtype=np.float64), strict=True):
            self.steps.append(int(step))
            self.columns.append(list(np.split(row, cuts)))

    def profiles(self) -> Any:
        """One panel per quantity: value against layer index at up to three measured steps."""
        from matplotlib import colormaps

        fig, axes = _grid()
        picks = sorted({0, (len(self.steps) - 1) // 2, len(self.steps) - 1})
        shades = colormaps["viridis"](np.linspace(0.85, 0.0, len(picks)))
        x = np.asarray(self.layers, dtype=float)
        for q, (ax, (title, _, per_sub, log)) in enumerate(zip(axes, QUANTITIES, strict=True)):
            for i, shade in zip(picks, shades, strict=True):
                values = self.columns[i][q]
                rows = values.reshape(len(self.layers), -1) if per_sub else values[:, None]
                for j in range(rows.shape[1]):
                    label = f"step {self.steps[i]}" if j == 0 else None
                    ax.plot(x, rows[:, j], color=shade, ls="-" if j == 0 else "--", lw=1.4, label=label)
            if log and _spans_decades(np.concatenate([self.columns[i][q] for i in picks])):
                ax.set_yscale("log")
            ax.set_title(title + ("\n(attn -, ffn --)" if per_sub else ""), fontsize=TITLE_PT)
            ax.set_xlabel("layer", fontsize=TICK_PT)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=TICK_PT)
        return fig

    def heatmaps(self, marks: dict[int, str] | None = None) -> Any:
        """One panel per quantity: layers (rows) x measured steps (columns); ``marks``: step -> label
        of a vertical line (e.g. where the collapse alarm went on)."""
        from matplotlib.colors import LogNorm

        fig, axes = _grid()
        steps = list(self.steps)
        n = len(self.layers)
        for q, (ax, (title, _, _, log)) in enumerate(zip(axes, QUANTITIES, strict=True)):
            data = np.stack([c[q] for c in self.columns], axis=1)  # [rows, steps]
            norm = None
            if log and _spans_decades(data):
                data = np.where(data > 0, data, np.nan)
                norm = LogNorm(np.nanmin(data), np.nanmax(data))
            im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                           extent=(-0.5, len(steps) - 0.5, 0.5, n + 0.5), norm=norm,
                           **({} if log else {"vmin": 0.0, "vmax": 1.0}))  # t_sim: 0..1
            ticks = np.linspace(0, len(steps) - 1, num=min(4, len(steps))).round().astype(int)
            ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
            yt = np.linspace(0, n - 1, num=min(8, n)).round().astype(int)
            ax.set_yticks(yt + 1, [str(self.layers[i]) for i in yt])
            for step, label in (marks or {}).items():
                if step in steps:
                    ax.axvline(steps.index(step), color="red", lw=1.2, ls=":")
                    ax.text(steps.index(step), n + 0.5, f" {label}", color="red", fontsize=8, va="top")
            ax.set_title(title, fontsize=TITLE_PT)
            ax.set_xlabel("step", fontsize=TICK_PT)
            ax.set_ylabel("layer", fontsize=TICK_PT)
            fig.colorbar(im, ax=ax).ax.tick_params(labelsize=TICK_PT)
        return fig
