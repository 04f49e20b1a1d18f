"""Collapse-metrics outputs: JSONL schema and append-on-resume, TensorBoard tags, custom-scalars layout,
heatmap image; and the transition detector on synthetic series."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from collapse_helpers import make_plugin, random_batches, run_step, small_config
from collapse_metrics.analysis.figures import fig_contraction, save
from collapse_metrics.analysis.outcome import read_run
from collapse_metrics.analysis.runs import load_collapse_jsonl
from collapse_metrics.table import SUB
from collapse_metrics.transition import TransitionConfig, TransitionDetector
from collapse_metrics.writers import JSONL_NAME
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.tensorboard import SummaryWriter

from megapost.model import LlamaModel

LAYER_KEYS = {"step", "layer", "sublayer", "t_sim_x", "t_sim_y", "t_sim_out", "resid_norm",
              "rms_factor_mean", "rms_factor_min", "rms_factor_max", "alpha", "c", "grad_norm",
              "grad_norm_layer", "grad_norm_norms"}
STEP_KEYS = {"step", "loss", "freq_loss_agg", "freq_loss_seq", "freq_loss_running", "freq_loss_corpus",
             "t_sim_embed", "t_sim_head", "transition", "grad_ratio", "collapsed", "early_warning"}


def train(tmp_path, steps, *argv, writer=None, norm="pre"):
    cfg = small_config(norm)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg, *argv, tb_dir=str(tmp_path), writer=writer)
    plugin.on_model_built(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        run_step(plugin, model, step, random_batches(cfg, 2, seed=step), opt if step else None)
    plugin.close()
    return plugin


def test_jsonl_and_tensorboard(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    train(tmp_path, [0, 1, 2, 3, 4], "--collapse-at-init", "--collapse-interval", "2",
          "--collapse-image-interval", "2", writer=writer)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    assert len(lines) == 3 * (3 * 2 + 1)  # steps 0, 2, 4: 3 layers x 2 sublayers + 1 step record
    layer_recs = [r for r in lines if "layer" in r]
    step_recs = [r for r in lines if "layer" not in r]
    assert all(set(r) == LAYER_KEYS for r in layer_recs) and all(set(r) == STEP_KEYS for r in step_recs)
    assert [r["step"] for r in step_recs] == [0, 2, 4]
    assert all(r["t_sim_out"] is None for r in layer_recs)  # Pre-Norm
    assert all(r["alpha"] is None and r["grad_norm"] is None for r in layer_recs if r["step"] == 0)
    assert all(r["alpha"] > 0 and r["grad_norm"] > 0 for r in layer_recs if r["step"] == 2)

    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    p = "collapse_layers"  # per-layer detail, behind the few summary cards of "collapse/"
    for tag in (f"{p}/t_sim/L01/attn/x", f"{p}/t_sim/L03/ffn/y", f"{p}/rms_factor/L02/ffn/min",
                f"{p}/resid_norm/L01/ffn", f"{p}/alpha/L02/attn", f"{p}/c/L03/ffn",
                f"{p}/grad_norm/L01", f"{p}/grad_norm/L01/attn", f"{p}/grad_norm/L01/ffn",
                f"{p}/grad_norm/L01/norms", "collapse/freq_loss/agg", "collapse/freq_loss/seq",
                "collapse/freq_loss/running", "collapse/t_sim/embed", "collapse/t_sim/head", "collapse/loss",
                "collapse/grad_ratio", "collapse/log10_grad_ratio", "collapse/depth/alpha/mean",
                "collapse/depth/t_sim_out/max", "collapse/depth/grad_norm_layer/min"):
        assert tag in scalars, tag
    assert not [t for t in scalars if t.startswith("collapse/") and re.search(r"/L\d\d", t)]
    assert len([t for t in scalars if t.startswith("collapse/")]) <= 40
    assert f"{p}/t_sim/L01/attn/out" not in scalars  # null under Pre-Norm: not written
    assert [e.step for e in events.Scalars(f"{p}/t_sim/L02/attn/y")] == [0, 2, 4]
    assert [e.step for e in events.Scalars(f"{p}/alpha/L02/attn")] == [2, 4]
    # across depth: min/mean/max over layers, of the same numbers as the detail
    alphas = [events.Scalars(f"{p}/alpha/L0{n}/{k}")[-1].value for n in (1, 2, 3) for k in ("attn", "ffn")]
    assert events.Scalars("collapse/depth/alpha/max")[-1].value == pytest.approx(max(alphas))
    mean = events.Scalars("collapse/depth/alpha/mean")[-1].value
    assert mean == pytest.approx(float(np.mean(alphas)))
    outs = [events.Scalars(f"{p}/t_sim/L0{n}/ffn/y")[-1].value for n in (1, 2, 3)]  # Pre-Norm: Y
    assert events.Scalars("collapse/depth/t_sim_out/min")[-1].value == pytest.approx(min(outs))
    for tag in ("collapse/depth_profiles", "collapse/heatmaps"):  # every 2nd measured step
        assert [e.step for e in events.Images(tag)] == [2, 4], tag  # and the end (step 4, drawn at close)

    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {(cat.title, c.title): list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    regex = charts[("key layers", "L02 t_sim y: attn, ffn")][0]
    assert {t for t in scalars if re.search(regex, t)} == {f"{p}/t_sim/L02/{k}/y" for k in ("attn", "ffn")}
    layer_regex = charts[("key layers", "L03 grad norm of the layer")][0]
    assert {t for t in scalars if re.search(layer_regex, t)} == {f"{p}/grad_norm/L03"}
    assert [p for p in tmp_path.rglob("*tfevents*") if p.parent != tmp_path] == []  # one run, no sub-runs
    assert all(len({t for t in scalars if any(re.match(r, t) for r in rs)}) <= 3 for rs in charts.values())
    summary = charts[("depth", "alpha: min, mean, max across layers")][0]
    assert {t for t in scalars if re.search(summary, t)} == {f"collapse/depth/alpha/{s}"
                                                             for s in ("min", "mean", "max")}


def test_null_rms_factor_flows_to_jsonl_tensorboard_and_figures(tmp_path):
    """HybridNorm: the FFN has no residual-stream RMSNorm, so its RMS factor and c are JSON null, absent
    from TensorBoard (the attention's are there), the figures still draw, titled from args.json, and the
    early-warning replay is off (the deepest residual sum is not normalised)."""
    writer = SummaryWriter(str(tmp_path))
    train(tmp_path, [1, 2], writer=writer, norm="hybrid")
    writer.close()
    recs = [json.loads(line) for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    layer_recs = [r for r in recs if "layer" in r]
    for r in layer_recs:
        ffn = r["sublayer"] == "ffn"
        for f in ("rms_factor_mean", "rms_factor_min", "rms_factor_max", "c", "t_sim_out"):
            assert (r[f] is None) == ffn, (r["layer"], r["sublayer"], f)
        assert r["resid_norm"] > 0 and r["alpha"] > 0
    scalars = set(EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"])
    p = "collapse_layers"
    assert f"{p}/rms_factor/L02/attn/mean" in scalars and f"{p}/c/L02/attn" in scalars
    assert not [t for t in scalars if re.match(rf"{p}/(rms_factor|c)/L\d\d/ffn", t)]
    assert f"{p}/resid_norm/L02/ffn" in scalars and "collapse/depth/rms_factor/mean" in scalars

    (tmp_path / "args.json").write_text(json.dumps({"norm_position": "hybrid", "qk_norm": False}))
    run = load_collapse_jsonl(tmp_path / JSONL_NAME)
    assert run.norm_label == "HybridNorm" and not run.deepest_normalised
    assert np.isnan(run.layer["ffn"]["rms_factor_mean"]).all()
    png = save(fig_contraction(run, run.window(10)), tmp_path / "fig4.png")  # the RMS-factor figure
    assert png.stat().st_size > 10_000
    assert not any(row.post_norm for row in read_run(tmp_path / JSONL_NAME))


def test_jsonl_appends_on_resume(tmp_path):
    first = train(tmp_path, [1, 2])
    second = make_plugin(small_config("pre"), tb_dir=str(tmp_path))
    second.load_state_dict(first.state_dict())
    assert second.running.num_tokens == first.running.num_tokens > 0
    torch.manual_seed(0)
    model = LlamaModel(small_config("pre"))
    batches = random_batches(small_config("pre"), 2, seed=3)
    run_step(second, model, 3, batches, torch.optim.SGD(model.parameters()))
    second.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    assert steps == [1] * 7 + [2] * 7 + [3] * 7


def series(n, jump_at=None, tsim_jump=0.0, loss_jump=0.0, seed=0):
    rng = np.random.default_rng(seed)
    t = 0.3 + 0.005 * rng.standard_normal(n)
    loss = 4.0 - np.linspace(0, 0.5, n) + 0.01 * rng.standard_normal(n)
    if jump_at is not None:
        t[jump_at:] += tsim_jump
        loss[jump_at:] += loss_jump
    return t, loss


@pytest.mark.parametrize(("tsim_jump", "loss_jump", "flagged"), [
    (0.5, 2.0, [60]),  # both rise sharply together: one alert, at the first step
    (0.5, 0.0, []),  # t_sim alone
    (0.0, 2.0, []),  # loss alone
    (0.0, 0.0, []),  # noise and a falling loss
    (0.02, 0.02, []),  # significant in z but below the minimum rises
])
def test_transition_detector(tsim_jump, loss_jump, flagged):
    t, loss = series(120, jump_at=60, tsim_jump=tsim_jump, loss_jump=loss_jump)
    det = TransitionDetector(TransitionConfig())
    events = [det.update(s, float(a), float(b)) for s, (a, b) in enumerate(zip(t, loss, strict=True))]
    assert [e.step for e in events if e is not None] == flagged
    if flagged:
        assert "transition at step 60" in next(e for e in events if e is not None).line()
    restored = TransitionDetector(TransitionConfig())
    restored.load_state_dict(det.state_dict())
    assert restored.state_dict() == det.state_dict()
    assert det.update(999, math.nan, 1.0) is None and det.update(999, None, 1.0) is None


def test_transition_flag_reaches_outputs(tmp_path, capsys):
    plugin = make_plugin(small_config("post"), "--collapse-transition-warmup", "3", tb_dir=str(tmp_path))
    for step, (t, loss) in enumerate([(0.30, 4.0), (0.31, 3.9), (0.30, 3.85), (0.31, 3.8), (0.9, 6.0)], 1):
        reduced = {"sub": torch.zeros(3, 2, len(SUB)), "rms_ext": torch.zeros(3, 2, 2),
                   "grad": torch.zeros(3, 5), "site": torch.tensor([[0.0, 0.0], [t, 1.0]]),
                   "labels": torch.zeros(40),
                   "label_seq": torch.zeros(2), "loss": torch.tensor([loss, 1.0])}
        plugin._finish(step, reduced)
    plugin.close()
    assert plugin.last["step_record"]["transition"] is True
    assert "[collapse] transition at step 5" in capsys.readouterr().out
    last = json.loads((tmp_path / JSONL_NAME).read_text().splitlines()[-1])
    assert last["transition"] is True and last["freq_loss_agg"] is None
