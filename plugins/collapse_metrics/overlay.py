"""TensorBoard series that overlay as runs, so the Scalars page colours them apart with a legend.

TensorBoard colours by run (one run = one directory of event files). Beside the run's own tags
(writers.py), this writes, under the run's TensorBoard directory:
    layers/L{l}/   one run per layer: layer/t_sim/{k}/{x|y|out}, layer/alpha/{k}, layer/c/{k},
                   layer/rms_factor/{k}, layer/resid_norm/{k}, layer/log10_grad_norm (+ /{k})
    loss/{lm_loss|freq_agg|freq_seq|freq_running|freq_corpus}/   one run per curve: loss/vs_frequency_loss
and in the run itself ``collapse/log10_grad_ratio`` (the first/last-layer gradient ratio spans decades)
and the text ``collapse/state`` at each step the collapse alarm switches (a marker smoothing cannot ramp).
"""

from __future__ import annotations

import math
import os
from typing import Any

LOSS_RUNS = {"lm_loss": "loss", "freq_agg": "freq_loss_agg", "freq_seq": "freq_loss_seq",
             "freq_running": "freq_loss_running", "freq_corpus": "freq_loss_corpus"}


def _log10(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    return math.log10(value) if ok else None


def layer_series(rec: dict[str, Any]) -> dict[str, float | None]:
    """Tags of one (layer, sublayer) record in its layer's run."""
    k = rec["sublayer"]
    tags = {f"layer/t_sim/{k}/{t}": rec[f"t_sim_{t}"] for t in ("x", "y", "out")}
    tags |= {f"layer/alpha/{k}": rec["alpha"], f"layer/c/{k}": rec["c"],
             f"layer/rms_factor/{k}": rec["rms_factor_mean"], f"layer/resid_norm/{k}": rec["resid_norm"],
             f"layer/log10_grad_norm/{k}": _log10(rec["grad_norm"])}
    if rec.get("grad_norm_layer") is not None:
        tags["layer/log10_grad_norm"] = _log10(rec["grad_norm_layer"])
    return tags


class Overlay:
    """Event-file subdirectories of ``log_dir`` (the run's TensorBoard directory), opened lazily."""

    def __init__(self, main: Any, log_dir: str) -> None:
        self.main, self.log_dir = main, log_dir
        self.writers: dict[str, Any] = {}
        self.collapsed: float | None = None

    def _writer(self, sub: str) -> Any:
        if sub not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            self.writers[sub] = SummaryWriter(os.path.join(self.log_dir, sub), max_queue=100, flush_secs=10)
        return self.writers[sub]

    def _put(self, writer: Any, tag: str, value: float | None, step: int) -> None:
        if value is not None and math.isfinite(value):
            writer.add_scalar(tag, value, step)

    def write(self, step: int, layer_records: list[dict[str, Any]], step_record: dict[str, Any]) -> None:
        for rec in layer_records:
            writer = self._writer(os.path.join("layers", f"L{rec['layer']:02d}"))
            for tag, value in layer_series(rec).items():
                self._put(writer, tag, value, step)
        for run, field in LOSS_RUNS.items():
            self._put(self._writer(os.path.join("loss", run)), "loss/vs_frequency_loss",
                      step_record.get(field), step)
        self._put(self.main, "collapse/log10_grad_ratio", _log10(step_record.get("grad_ratio")), step)
        collapsed = step_record.get("collapsed")
        if collapsed is not None and float(collapsed) != self.collapsed:
            state = "COLLAPSED (alarm on)" if collapsed else "not collapsed (alarm off)"
            if self.collapsed is not None or collapsed:
                self.main.add_text("collapse/state", f"step {step}: {state}", step)
            self.collapsed = float(collapsed)

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
