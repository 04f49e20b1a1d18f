"""TensorBoard content written by the real trainer at tiny sizes, read back with TensorBoard's own loader
(the runs it finds under a --logdir, their tags, the Custom Scalars layout)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from launch_utils import run as launch
from launch_utils import tiny_model_flags


def run_flags(data: Any, out: Path, norm: str, layers: int) -> list[str]:
    """A tiny collapse-metrics run (d 32, 4 steps, images every 2nd measured step) writing into ``out``."""
    return tiny_model_flags(data, **{
        "--num-layers": layers, "--hidden-size": 32, "--ffn-hidden-size": 64, "--num-attention-heads": 4,
        "--norm-position": norm, "--train-iters": 4, "--micro-batch-size": 2, "--global-batch-size": 2,
        "--log-interval": 2, "--tensorboard-dir": out, "--plugins": "collapse_metrics",
        "--collapse-image-interval": 2})


def train_runs(data: Any, logdir: Path, runs: dict[str, tuple[str, int]]) -> None:
    """Train each ``name: (norm, layers)`` into ``logdir/name``, one after another in one child process
    (``megapost.pretrain.run``, the real trainer; the imports paid once)."""
    argvs = [run_flags(data, logdir / name, norm, layers) for name, (norm, layers) in runs.items()]
    code = ("import json, sys\nfrom megapost.pretrain import run\n"
            "for argv in json.loads(sys.argv[1]):\n    run(argv)")
    launch([sys.executable, "-c", code, json.dumps(argvs)])


def runs_and_tags(logdir: Path) -> dict[str, dict[str, list[str]]]:
    """run -> {"scalars": [...], "images": [...], "custom_scalars": [...]}: the tags of each TensorBoard
    plugin, as TensorBoard's multiplexer sees ``--logdir logdir`` (a run per directory of event files)."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"tensors": 0})
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    by_plugin = {kind: mux.PluginRunToTagToContent(kind) for kind in ("scalars", "images", "custom_scalars")}
    return {run: {kind: sorted(by_plugin[kind].get(run, {})) for kind in by_plugin} for run in mux.Runs()}


def custom_charts(run_dir: Path) -> dict[tuple[str, str], list[str]]:
    """(category, chart title) -> the chart's tag regexes, from the run's Custom Scalars layout."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    return {(cat.title, chart.title): list(chart.multiline.tag) for cat in layout.category
            for chart in cat.chart}


def chart_lines(regexes: list[str], runs: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """run -> the scalar tags one Custom Scalars chart draws for it (TensorBoard: re.match)."""
    return {run: [t for t in tags["scalars"] if any(re.match(r, t) for r in regexes)]
            for run, tags in runs.items()}
