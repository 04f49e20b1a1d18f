"""The toy collapse on real text (examples/collapse_toy.sh settings, 60 steps): Post-Norm collapses,
Pre-Norm with identical settings does not — asserted from the logged collapse_metrics.jsonl."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from launch_utils import pretrain

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs


def _run(norm: str, prefix: str, tokenizer: str, out) -> tuple[list[dict], dict, str]:
    flags = {"--norm-position": norm, "--num-layers": 12, "--hidden-size": 64, "--ffn-hidden-size": 192,
             "--num-attention-heads": 4, "--seq-length": 128, "--micro-batch-size": 8,
             "--global-batch-size": 8, "--train-iters": 60, "--lr": 1e-2, "--min-lr": 1e-3,
             "--lr-warmup-iters": 0, "--init-variance": "paper", "--seed": 1234, "--data-path": prefix,
             "--tokenizer-model": tokenizer, "--tensorboard-dir": out, "--eval-interval": 0,
             "--plugins": "collapse_metrics", "--collapse-interval": 10}
    proc = pretrain([str(x) for item in flags.items() for x in item])
    records = [json.loads(line) for line in (out / "collapse_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    layers = {(r["step"], r["layer"], r["sublayer"]): r for r in records if "layer" in r}
    return steps, layers, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def news(tmp_path_factory):
    from megapost.data import prepare_default_data

    return prepare_default_data(tmp_path_factory.mktemp("news"), progress=False, log=None)


def test_post_norm_collapses_and_pre_norm_does_not(news, tmp_path) -> None:
    prefix, tokenizer = map(str, news)
    with ThreadPoolExecutor(2) as pool:  # two one-thread runs side by side: one per core
        runs = [pool.submit(_run, norm, prefix, tokenizer, tmp_path / norm) for norm in ("post", "pre")]
        (post_steps, post, post_log), (pre_steps, pre, pre_log) = (r.result() for r in runs)

    def grad_ratio(layers: dict, step: int) -> float:  # layer-1 / layer-12 parameter gradient norm
        return layers[(step, 1, "attn")]["grad_norm_layer"] / layers[(step, 12, "attn")]["grad_norm_layer"]

    # Post-Norm: the head input is rank-collapsed and early layers get (numerically) no gradient.
    for rec in post_steps[1:]:
        assert rec["t_sim_head"] > 0.9999
        assert grad_ratio(post, rec["step"]) < 1e-6
        assert rec["loss"] > rec["freq_loss_running"] - 0.05  # Theorem 3.8's floor, up to sampling
    # Pre-Norm: gradients reach layer 1 at full strength and similarity starts to fall.
    for rec in pre_steps:
        assert grad_ratio(pre, rec["step"]) > 1e-2
    assert pre_steps[-1]["t_sim_head"] < pre_steps[0]["t_sim_head"] - 0.003
    assert pre_steps[-1]["t_sim_head"] < post_steps[-1]["t_sim_head"] - 0.003
    # the collapsed-state alarm: on from the first measured step after init, never for Pre-Norm
    first = next(rec["step"] for rec in post_steps if rec["collapsed"])
    assert first <= 20 and all(rec["collapsed"] for rec in post_steps if rec["step"] >= first)
    assert f"[collapse] COLLAPSED at step {first}" in post_log
    assert not any(rec["collapsed"] for rec in pre_steps) and "COLLAPSED" not in pre_log
