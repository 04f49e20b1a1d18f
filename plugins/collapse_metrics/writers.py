"""Sinks of the logging rank: the JSONL (every layer) and TensorBoard, all in the run's one writer
(tags and Custom Scalars layout: tb_layout.py; images of every layer: images.py). Alarm lines are also
TensorBoard text (``collapse/alerts``), the alarm's switches the text ``collapse/state``. Null values
(e.g. t_sim/out under Pre-Norm, alpha at step 0) are not written. Figures are drawn off the training
thread (one worker thread, in step order, on a copy of the values; ``close`` waits for them).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from megapost.plugin_api import atomic_write_text

from .images import DepthImages
from .tb_layout import AlarmSteps, custom_scalars_layout, depth_tags, key_layers, layer_tags, step_tags

JSONL_NAME = "collapse_metrics.jsonl"
# JSONL fields after "step": per (layer, sublayer) record, and the step's own record
LAYER_FIELDS = ("layer", "sublayer", "t_sim_x", "t_sim_y", "t_sim_out", "resid_norm", "rms_factor_mean",
                "rms_factor_min", "rms_factor_max", "alpha", "c", "grad_norm", "grad_norm_layer",
                "grad_norm_norms")
STEP_FIELDS = ("loss", "freq_loss_agg", "freq_loss_seq", "freq_loss_running", "freq_loss_corpus",
               "t_sim_embed", "t_sim_head", "transition", "grad_ratio", "collapsed", "early_warning")


def _step_of(line: str) -> int:
    """A JSONL record's step; a torn last line (a killed writer) counts as past any resume point."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def finite(value: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Writers:
    """TensorBoard (``writer`` may be None) and the JSONL file (``directory`` may be None)."""

    def __init__(self, writer: Any, directory: str | None, layers: tuple[int, ...],
                 image_interval: int) -> None:
        self.writer = writer
        self.layers, self.key_layers = layers, frozenset(key_layers(layers))
        self.image_interval = image_interval
        self.images = DepthImages(layers)
        self.alarms = AlarmSteps()
        self.collapsed: bool | None = None  # the alarm's last state, for the collapse/state text
        self.marks: dict[int, str] = {}  # steps the alarm went on, marked on the heatmaps
        self.measured = 0
        self.imaged = 0  # self.measured when the images were last drawn
        self.layout_written = False
        self.drawer: ThreadPoolExecutor | None = None
        self.drawing: list[Future] = []
        self.jsonl = None
        self.jsonl_path = os.path.join(directory, JSONL_NAME) if directory else None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._open()

    def _open(self) -> None:
        self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115

    def drop_after(self, step: int) -> None:
        """Resuming at ``step``: rewrite the JSONL (atomically) without the records logged past it."""
        if self.jsonl is None:
            return
        self.jsonl.close()
        with open(self.jsonl_path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if line.strip() and _step_of(line) <= step]
        if len(kept) != len(lines):
            atomic_write_text(self.jsonl_path, "".join(kept))
        self._open()

    def write(self, step: int, layer_records: list[dict[str, Any]], step_record: dict[str, Any]) -> None:
        self.measured += 1
        self.images.add(step, layer_records)
        if self.jsonl is not None:
            lines = [(r, LAYER_FIELDS) for r in layer_records] + [(step_record, STEP_FIELDS)]
            self.jsonl.write("".join(json.dumps({"step": step, **{f: finite(r[f]) for f in fields}}) + "\n"
                                     for r, fields in lines))
            self.jsonl.flush()
        if self.writer is None:
            return
        if not self.layout_written:
            normalised = any(r["t_sim_out"] is not None for r in layer_records)
            self.writer.add_custom_scalars(custom_scalars_layout(self.layers, normalised))
            self.layout_written = True
        tags = step_tags(step_record) | depth_tags(layer_records) | self.alarms.tags(step, step_record)
        for rec in layer_records:
            if rec["layer"] in self.key_layers:
                tags |= layer_tags(rec)
        for tag, value in tags.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self._state_text(step, step_record.get("collapsed"))
        if self.image_interval and self.measured % self.image_interval == 0:
            self._draw(step)

    def _state_text(self, step: int, collapsed: bool | None) -> None:
        """The text ``collapse/state`` at each step the alarm switches (and not for a run never flagged)."""
        if collapsed is None or bool(collapsed) == self.collapsed:
            return
        if self.collapsed is not None or collapsed:
            state = "COLLAPSED (alarm on)" if collapsed else "not collapsed (alarm off)"
            self.writer.add_text("collapse/state", f"step {step}: {state}", step)
        if collapsed:
            self.marks[step] = "alarm"
        self.collapsed = bool(collapsed)

    def _draw(self, step: int) -> None:
        """The depth profiles and heatmaps of every measured layer (images.py) at ``step``, drawn by the
        worker thread from a copy of the values so far."""
        if self.drawer is None:
            self.drawer = ThreadPoolExecutor(1, thread_name_prefix="collapse-figures")
        self.drawing = [f for f in self.drawing if not f.done() or f.exception() is not None]
        self.drawing.append(self.drawer.submit(self._render, self.images.copy(), dict(self.marks), step))
        self.imaged = self.measured

    def _render(self, images: DepthImages, marks: dict[int, str], step: int) -> None:
        self.writer.add_figure("collapse/depth_profiles", images.profiles(), step, close=True)
        self.writer.add_figure("collapse/heatmaps", images.heatmaps(marks), step, close=True)

    def state_dict(self) -> dict[str, Any]:
        """The record so far (alarm steps, alarm state and marks, image cadence and history), for the
        checkpoint: a resumed run continues it instead of starting a second one."""
        return {"alarms": dict(self.alarms.on_since), "collapsed": self.collapsed,
                "marks": [[step, label] for step, label in self.marks.items()], "measured": self.measured,
                "imaged": self.imaged, "images": self.images.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alarms.on_since.update({k: v for k, v in state["alarms"].items() if k in self.alarms.on_since})
        self.collapsed = state["collapsed"]
        self.marks = {int(step): label for step, label in state["marks"]}
        self.measured, self.imaged = int(state["measured"]), int(state["imaged"])
        self.images.load_state_dict(state["images"])

    def alert(self, step: int, line: str) -> None:
        """An alarm line as TensorBoard text (``collapse/alerts``)."""
        if self.writer is not None:
            self.writer.add_text("collapse/alerts", line, step)
            self.writer.flush()

    def guard(self, step: int, record: dict[str, Any]) -> None:
        """A guard rollback: a JSONL record ``{"step", "guard": {...}}`` and ``collapse/guard/*`` scalars."""
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "guard": record}) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            self.writer.add_scalar("collapse/guard/rollbacks", record["rollback"], step)
            self.writer.add_scalar("collapse/guard/to_step", record["to_step"], step)
            self.writer.add_scalar("collapse/guard/peak_lr", record["lr"], step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            if self.image_interval and self.measured > self.imaged:  # the last steps drawn, too
                self._draw(self.images.steps[-1])
            if self.drawer is not None:
                self.drawer.shutdown(wait=True)
                self.drawer = None
                for done in self.drawing:
                    done.result()  # a figure that failed raises here
            self.writer.flush()
