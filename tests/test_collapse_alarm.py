"""The collapsed-state alarm (collapse_metrics/state.py) and the smaller collapse-metrics fixes: the
first-batch double count under --collapse-at-init, the corpus frequency loss and its cache, the
heatmap default, the per-layer-group custom scalars, the run outcome of a JSONL."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from collapse_helpers import collapse_config, make_plugin, random_batches, run_step, small_config
from collapse_metrics import corpus
from collapse_metrics.analysis.outcome import read_run, summarize
from collapse_metrics.frequency import aggregated_frequency_loss, label_counts
from collapse_metrics.plugin import image_interval
from collapse_metrics.state import CollapseState, StateConfig, grad_ratio, is_collapsed
from collapse_metrics.tb_layout import custom_scalars_layout, key_layers
from launch_utils import pretrain, read_scalars, tiny_model_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megapost.data import IndexedDataset
from megapost.data.gpt_dataset import split_document_ranges
from megapost.model import LlamaModel
from megapost.train.plugin_services import Corpus


def _alarm_run(tiny_data, norm: str, out) -> tuple[list[dict], str]:
    """12 layers, no warmup, lr 0.1 on the tiny corpus: Post-Norm collapses within ~6 steps while
    Pre-Norm sits on the unigram plateau (t_sim(X^H) ~ 0.99) and then trains."""
    flags = tiny_model_flags(tiny_data, **{
        "--norm-position": norm, "--num-layers": 12, "--hidden-size": 32, "--ffn-hidden-size": 96,
        "--micro-batch-size": 4, "--global-batch-size": 4, "--train-iters": 10, "--lr": 0.1, "--min-lr": 0.1,
        "--lr-warmup-iters": 0, "--init-variance": "paper", "--seed": 1, "--log-interval": 100,
        "--tensorboard-dir": out, "--plugins": "collapse_metrics", "--collapse-interval": 2})
    proc = pretrain(flags)
    steps = [json.loads(line) for line in (out / "collapse_metrics.jsonl").read_text().splitlines()]
    return [r for r in steps if "loss" in r], proc.stdout + proc.stderr


@pytest.mark.integration
def test_alarm_flags_collapsed_post_norm_not_its_pre_norm_twin(tiny_data, tmp_path):
    post, post_log = _alarm_run(tiny_data, "post", tmp_path / "post")
    pre, pre_log = _alarm_run(tiny_data, "pre", tmp_path / "pre")
    flagged = [r["step"] for r in post if r["collapsed"]]
    assert flagged and flagged == [r["step"] for r in post if r["step"] >= flagged[0]]  # stays flagged
    assert flagged[0] <= 8 and post[-1]["grad_ratio"] < 1e-6 and post[-1]["t_sim_head"] > 0.99
    assert f"[collapse] COLLAPSED at step {flagged[0]}" in post_log
    # Pre-Norm passes through the same plateau (t_sim(X^H) high, loss near the frequency loss) but its
    # early layers keep their gradient: never flagged
    assert max(r["t_sim_head"] for r in pre) > 0.95
    assert not any(r["collapsed"] for r in pre) and min(r["grad_ratio"] for r in pre) > 1e-2
    assert "COLLAPSED" not in pre_log
    # TensorBoard: the step the alarm went on, flat from there (smoothing cannot ramp a constant)
    assert read_scalars(tmp_path / "post", "collapse/alarm/collapsed_at_step") == dict.fromkeys(flagged,
                                                                                               flagged[0])
    assert read_scalars(tmp_path / "pre", "collapse/alarm/collapsed_at_step") == {}
    acc = EventAccumulator(str(tmp_path / "post"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t for t in acc.Tags()["tensors"] if t.startswith("collapse/alerts")]
    assert texts, acc.Tags()["tensors"]
    alert = acc.Tensors(texts[0])[0]
    assert alert.step == flagged[0] and b"COLLAPSED" in alert.tensor_proto.string_val[0]
    # the corpus frequency loss sits beside the loss; the collapsed loss cannot go below it (Thm 3.8)
    freq = post[-1]["freq_loss_corpus"]
    assert freq == pre[-1]["freq_loss_corpus"] and min(r["loss"] for r in post) > freq - 0.1
    # the offline replay (tools/stability_sweep.py) agrees with the live alarm
    outcome = summarize(read_run(tmp_path / "post" / "collapse_metrics.jsonl"), freq, window=2)
    assert outcome.alarm_step == flagged[0] and outcome.outcome == "collapsed"
    assert summarize(read_run(tmp_path / "pre" / "collapse_metrics.jsonl"), freq, window=2).alarm_step is None


def test_state_rule_and_lines():
    cfg = StateConfig()
    assert is_collapsed(0.999, 1e-10, cfg) is True
    assert is_collapsed(0.999, 3.0, cfg) is False  # the healthy plateau: t_sim high, gradients alive
    assert is_collapsed(0.5, 1e-10, cfg) is False
    assert is_collapsed(None, 1e-10, cfg) is None and is_collapsed(0.999, None, cfg) is None
    state = CollapseState(cfg)
    assert state.update(1, 0.99, 2.0) == (False, None)
    flagged, line = state.update(2, 0.999, 1e-9)
    assert flagged and line.startswith("[collapse] COLLAPSED at step 2")
    assert state.update(3, 0.999, 1e-10) == (True, None)  # one line per change
    assert state.update(3, 0.999, 2e-2) == (True, None)  # stays while the head input is rank-collapsed
    restored = CollapseState(cfg)
    restored.load_state_dict(state.state_dict())
    flagged, line = restored.update(4, 0.4, 1.0)
    assert flagged is False and "recovered at step 4 (collapsed since step 2)" in line
    recs = [{"layer": 1, "grad_norm_layer": 1e-12}, {"layer": 12, "grad_norm_layer": 0.1},
            {"layer": 5, "grad_norm_layer": None}]
    assert grad_ratio(recs) == pytest.approx(1e-11)
    assert grad_ratio(recs[:1]) is None
    assert grad_ratio([{"layer": 1, "grad_norm_layer": 0.0}, {"layer": 2, "grad_norm_layer": 0.0}]) == 0.0


def test_at_init_counts_the_first_batch_once(tmp_path):
    cfg = small_config("pre")
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg, "--collapse-at-init", tb_dir=str(tmp_path))
    plugin.on_model_built(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first, second = random_batches(cfg, 1, seed=1), random_batches(cfg, 1, seed=2)
    for step, batches in ((0, first), (1, first), (2, second)):  # step 1 trains on step 0's batch
        run_step(plugin, model, step, batches, opt if step else None)
    plugin.close()
    expected = label_counts(torch.cat([first[0]["labels"], second[0]["labels"]]), cfg.vocab_size)
    assert torch.equal(plugin.running.counts, expected)


def test_corpus_frequency_loss_is_the_train_split_and_cached(tiny_data, tmp_path, monkeypatch):
    data = Corpus(tiny_data.prefix, "90,10,0", str(tmp_path))
    result = corpus.train_split_frequency_loss(data, 32, tiny_data.vocab_size)
    indexed = IndexedDataset(tiny_data.prefix)
    start, end = split_document_ranges(len(indexed), "90,10,0")[0]
    labels = np.concatenate([indexed[i] for i in range(start, end)])
    assert result.num_tokens == len(labels) < indexed.num_tokens
    assert result.aggregated == pytest.approx(aggregated_frequency_loss(labels, tiny_data.vocab_size))
    assert list(tmp_path.glob("*-freq-*.json"))

    def no_stream(*_a, **_k):
        raise AssertionError("recomputed instead of reading the cache")

    monkeypatch.setattr(corpus, "streaming_frequency_loss", no_stream)
    assert corpus.train_split_frequency_loss(data, 32, tiny_data.vocab_size) == result


def test_heatmap_default_gives_a_short_run_a_few_images():
    assert 20 // image_interval(collapse_config("--collapse-interval", "10"), 200) >= 4  # tiny-cpu
    assert 4000 // image_interval(collapse_config("--collapse-interval", "10"), 40000) <= 6
    assert image_interval(collapse_config("--collapse-image-interval", "0"), 0) == 0


def test_key_layers_are_first_quartiles_last():
    assert key_layers(tuple(range(1, 49))) == (1, 13, 25, 36, 48)  # 0, 1/4, 1/2, 3/4, 1 of 47 gaps
    assert key_layers((1, 2, 3)) == (1, 2, 3) and key_layers((1, 2, 47, 48)) == (1, 2, 47, 48)
    layout = custom_scalars_layout(tuple(range(1, 49)))
    assert list(layout) == ["collapse", "depth", "key layers"]
    assert {title.split()[0] for title in layout["key layers"]} == {"L01", "L13", "L25", "L36", "L48"}


def test_outcome_of_a_delayed_collapse(tmp_path):
    """Ground truth on a synthetic JSONL: learns 1 nat below L, then t_sim(X^H) -> 1 at step 30."""
    path = tmp_path / "collapse_metrics.jsonl"
    with open(path, "w") as f:
        for step in range(2, 62, 2):
            late = step >= 30
            for layer, grad in ((1, 1e-12 if late else 0.5), (4, 0.2)):
                f.write(json.dumps({"step": step, "layer": layer, "sublayer": "attn",
                                    "grad_norm_layer": grad}) + "\n")
            f.write(json.dumps({"step": step, "loss": 6.0 if late else 5.0 + (step < 10),
                                "t_sim_head": 0.999 if late else 0.3}) + "\n")
    out = summarize(read_run(path), freq_loss=6.0, window=3)
    assert out.outcome == "collapsed" and out.transition_step == 30 and out.delayed
    assert out.alarm_step == 30 and out.best_gap == pytest.approx(-1.0)
    assert math.isclose(out.final_grad_ratio, 5e-12)
