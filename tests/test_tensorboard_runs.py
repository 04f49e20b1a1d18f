"""One TensorBoard run per training run, readable at the paper's 48 layers: a Post-Norm 48-layer and a
Pre-Norm 4-layer run through the real trainer, read back with TensorBoard's own loader. (The rendered
page in headless Chromium: test_tensorboard_browser.py; both -m slow. The default suite's cheap checks
are in test_collapse_outputs.py and test_collapse_alarm.py.)"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from tensorboard_utils import chart_lines, custom_charts, runs_and_tags, train_runs

# two real trainings (48 and 4 layers): ~100 s on 2 busy cores
pytestmark = [pytest.mark.slow, pytest.mark.integration]

KEY_48 = {1, 13, 25, 36, 48}  # first, quartiles (12.75 -> 13, 24.5 -> 25, 36.25 -> 36), last of 1..48


@pytest.fixture(scope="module")
def logdir(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train_runs(tiny_data, root, {"post48": ("post", 48), "pre4": ("pre", 4)})
    return root


def test_one_tensorboard_run_per_training_run(logdir):
    runs = runs_and_tags(logdir)
    assert sorted(runs) == ["post48", "pre4"]  # no layers/L01 ... or loss/<curve> runs of their own
    for run, layers in (("post48", KEY_48), ("pre4", {1, 2, 3, 4})):
        scalars = runs[run]["scalars"]
        measured = {int(m.group(1)) for t in scalars if (m := re.match(r"collapse_layers/\w+/L(\d\d)", t))}
        assert measured == layers, run  # per-layer scalars for the key layers only
        assert len(scalars) < 200, (run, len(scalars))  # was ~22 per layer and sublayer set, per layer
        for image in ("collapse/depth_profiles", "collapse/heatmaps"):
            assert image in runs[run]["images"], (run, runs[run]["images"])
    assert "train/lm_loss" in runs["post48"]["scalars"]  # the trainer's own tags share the run


def test_depth_summaries_cover_every_layer_of_the_jsonl(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jsonl = (logdir / "post48" / "collapse_metrics.jsonl").read_text()
    records = [json.loads(line) for line in jsonl.splitlines()]
    last = max(r["step"] for r in records)
    layer_recs = [r for r in records if r["step"] == last and "layer" in r]
    assert sorted({r["layer"] for r in layer_recs}) == list(range(1, 49))  # the JSONL keeps every layer
    alphas = [r["alpha"] for r in layer_recs]
    resid = [r["resid_norm"] for r in layer_recs]
    acc = EventAccumulator(str(logdir / "post48"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()

    def value(tag: str) -> float:
        return acc.Scalars(tag)[-1].value

    assert value("collapse/depth/alpha/mean") == pytest.approx(float(np.mean(alphas)), rel=1e-5)
    assert value("collapse/depth/alpha/min") == pytest.approx(min(alphas), rel=1e-5)
    assert value("collapse/depth/resid_norm/max") == pytest.approx(max(resid), rel=1e-5)
    # images refreshed every 2nd measured step of the 4: steps 2 and 4
    assert [e.step for e in acc.Images("collapse/heatmaps")] == [2, 4]
    assert acc.Images("collapse/heatmaps")[-1].width >= 800  # a readable 2 x 3 grid of panels


def test_custom_charts_draw_at_most_seven_lines_for_post_beside_pre(logdir):
    runs = runs_and_tags(logdir)
    charts = custom_charts(logdir / "post48")
    assert len(charts) > 10
    for (category, title), regexes in charts.items():
        lines = chart_lines(regexes, runs)
        total = sum(len(tags) for tags in lines.values())
        assert 1 <= total <= 7, (category, title, lines)  # drawn, and each line its own colour
        assert all(len(tags) <= 3 for tags in lines.values()), (title, lines)
        # every tag it draws is named in the title (the chart has no legend): its layer and sublayer
        for tag in {t for tags in lines.values() for t in tags}:
            layer = re.search(r"/(L\d\d)(/|$)", tag)
            assert layer is None or layer.group(1) in title, (title, tag)
            assert not re.search(r"/(attn|ffn)(/|$)", tag) or "attn, ffn" in title, (title, tag)
