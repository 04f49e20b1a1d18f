"""Stage I at initialisation: recorded t_sim vs brute force, predictions vs theory, the alpha intervention,
and the CLI's JSON/PNG outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from collapse_metrics.analysis.stage1 import (
    analyse,
    init_variances,
    measure,
    predicted_increments,
    write_json,
)
from collapse_metrics.analysis.theory import attention_delta, ffn_delta, ffn_xi, intervention_delta

from megapost.model import LlamaModel, ModelConfig
from megapost.model.init import matrix_std
from megapost.train.plugin_services import InitModels

MODELS = InitModels()

ROOT = Path(__file__).resolve().parents[1]
N, D, F, L = 64, 64, 192, 4


def small_config(norm: str, **changes: float) -> ModelConfig:
    return ModelConfig(vocab_size=512, num_layers=L, hidden_size=D, ffn_hidden_size=F, num_attention_heads=4,
                       seq_length=N, norm_position=norm, init_variance="paper", **changes)


def brute_tsim(x: torch.Tensor) -> float:
    """||Pi X||_F^2 / ||X||_F^2 with the explicit n x n matrix Pi = 1 1^T / n, float64."""
    x = x.double()
    pi = torch.full((x.shape[0], x.shape[0]), 1.0 / x.shape[0], dtype=torch.float64)
    return float((pi @ x).square().sum() / x.square().sum())


@torch.no_grad()
def brute_activations(cfg: ModelConfig, tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """t_sim(X), t_sim(Y), t_sim(out), ||X||_F^2 per sublayer [S, L], recomputed from the block's parts."""
    model = LlamaModel(cfg).eval()
    keys = [f"{sub}_{f}" for sub in ("attn", "ffn") for f in ("t_x", "t_y", "t_out", "x_fro_sq")]
    out = {k: np.full((len(tokens), cfg.num_layers), np.nan) for k in keys}
    for i, seq in enumerate(tokens):
        x = model.embedding.word_embeddings(seq[None])
        for j, block in enumerate(model.layers):
            for sub, fn, norm in (("attn", block.attention, block.attention_norm),
                                  ("ffn", block.mlp, block.mlp_norm)):
                y = x + fn(x) if cfg.norm_position == "post" else x + fn(norm(x))
                out[f"{sub}_t_x"][i, j], out[f"{sub}_t_y"][i, j] = brute_tsim(x[0]), brute_tsim(y[0])
                out[f"{sub}_x_fro_sq"][i, j] = float(x.double().square().sum())
                if cfg.norm_position == "post":
                    y = norm(y)
                    out[f"{sub}_t_out"][i, j] = brute_tsim(y[0])
                x = y
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, N), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_recorded_tsim_matches_brute_force_and_theory(norm: str, tokens: torch.Tensor) -> None:
    cfg = small_config(norm, sublayer_init_multiplier=2.0)
    meas = measure(cfg, tokens, models=MODELS)
    ref = brute_activations(cfg, tokens)
    for sub in ("attn", "ffn"):
        for f in ("t_x", "t_y", "t_out", "x_fro_sq"):
            np.testing.assert_allclose(meas[sub][f], ref[f"{sub}_{f}"], rtol=2e-5, atol=1e-7,
                                       err_msg=f"{sub} {f}")
    # predictions: the theory's deltas at the measured inputs (s, xi from the init variances and norms)
    pred = predicted_increments(cfg, meas)
    var = init_variances(cfg, MODELS)
    sigma_w = D * var.sigma_v2 * var.sigma_o2
    xi0 = ffn_xi(D, F, var.sigma_w2_2, var.sigma_w3_2)
    nd = float(N * D)
    for i in range(len(tokens)):
        for j in range(L):
            x1 = ref["attn_x_fro_sq"][i, j] if norm == "pre" else nd
            x2 = ref["ffn_x_fro_sq"][i, j] if norm == "pre" else nd
            s = N * D * D * sigma_w / x1
            assert pred["attn"][i, j] == pytest.approx(attention_delta(s, ref["attn_t_x"][i, j], N), rel=1e-4)
            expect = ffn_delta(xi0 * nd / x2, ref["ffn_t_x"][i, j], N, D * var.sigma_w1_2)
            assert pred["ffn"][i, j] == pytest.approx(expect, rel=1e-4, abs=1e-9)
    assert np.all(pred["ffn"] <= 0.0)


def test_prefix_alpha_prediction_uses_corollary(tokens: torch.Tensor) -> None:
    cfg = small_config("post", prefix_alpha=0.5)
    meas = measure(cfg, tokens, models=MODELS)
    pred = predicted_increments(cfg, meas)
    s = D * init_variances(cfg, MODELS).sigma_w2(D)
    np.testing.assert_allclose(pred["attn"], intervention_delta(s, meas["attn"]["t_x"], N, 0.5), rtol=1e-10)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_alpha_one_removes_most_of_the_attention_increment(norm: str, tokens: torch.Tensor) -> None:
    cfg = small_config(norm, sublayer_init_multiplier=4.0)
    total = {a: analyse(c, measure(c, tokens, models=MODELS))["measured"]["total_attn_resid"]
             for a, c in ((a, dataclasses.replace(cfg, prefix_alpha=a)) for a in (0.0, 1.0))}
    assert total[0.0] > 0.05
    assert abs(total[1.0]) < 0.2 * total[0.0]


def test_cli_writes_json_and_figures_atomically(tiny_data, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import init_similarity

    out = tmp_path / "out"
    rc = init_similarity.main([
        "--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model, "--num-layers", "3",
        "--hidden-size", "32", "--ffn-hidden-size", "96", "--seq-length", "32", "--num-sequences", "2",
        "--multipliers", "1,4", "--prefix-alpha-sweep", "0,1", "--out", str(out),
    ])
    assert rc == 0
    for norm in ("post", "pre"):
        res = json.loads((out / f"init_similarity_{norm}.json").read_text())
        assert {"config", "num_sequences", "dtype", "runs", "data_path", "wall_s"} <= set(res)
        assert [r["multiplier"] for r in res["runs"]] == [1.0, 4.0]
        run = res["runs"][0]
        assert {"measured", "predicted", "band_ratios", "runtime_s", "prefix_alpha"} <= set(run)
        assert {"attn_resid", "attn_norm", "ffn_resid", "ffn_norm"} <= set(run["measured"]["mean"])
        assert len(run["predicted"]["iterated"]["t_attn"]) == 3
        assert np.asarray(run["measured"]["attn"]["t_x"]).shape == (2, 3)
        assert (out / f"fig1_init_similarity_{norm}.png").stat().st_size > 10_000
    post = json.loads((out / "init_similarity_post.json").read_text())
    assert set(post["prefix_alpha_removed"]) == {"0", "1"} and "prefix_alpha_sweep" in post
    assert all(v is not None for v in post["runs"][0]["measured"]["mean"]["attn_norm"])
    pre = json.loads((out / "init_similarity_pre.json").read_text())
    assert all(v is None for v in pre["runs"][0]["measured"]["mean"]["attn_norm"])  # nan -> null
    assert (out / "fig2_prefix_alpha.png").stat().st_size > 10_000
    # atomic: a failing write leaves the previous file intact and no temp file behind
    target = out / "init_similarity_post.json"
    before = target.read_bytes()
    with pytest.raises(TypeError):
        write_json(target, {"bad": object()})
    assert target.read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_other_placements_are_measured_and_their_theory_is_null(tmp_path: Path) -> None:
    """sandwich, deepnorm, mix, hybrid, pre-scaled, dyt: the recorded t_sim of X, Y and the normalised output
    equal the papers' dataflow computed by hand; the prediction is null (no closed form), and Fig 1 draws
    the measured curves alone."""
    from collapse_helpers import explicit_tsim, manual_forward
    from collapse_helpers import small_config as tiny_config
    from collapse_metrics.analysis.figures import plot_init_similarity
    from collapse_metrics.analysis.stage1 import _jsonable, theory_applies

    from megapost.model.placements import PLACEMENTS

    others = [p for p in PLACEMENTS if p not in ("post", "pre")]
    assert len(others) == 6
    for norm in others:
        cfg = tiny_config(norm, mix_post_fraction=0.5, seq_length=16)
        assert not theory_applies(cfg)
        gen = torch.Generator().manual_seed(1)
        seqs = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
        meas = measure(cfg, seqs, models=MODELS)
        with torch.no_grad():
            _, acts = manual_forward(LlamaModel(cfg), seqs)
        for (layer, k), a in ((key, v) for key, v in acts.items() if isinstance(key, tuple)):
            sub = ("attn", "ffn")[k]
            for field, name in (("t_x", "x"), ("t_y", "y"), ("t_out", "out")):
                got = meas[sub][field][:, layer - 1]
                if a[name] is None:
                    assert np.isnan(got).all(), (norm, layer, sub, field)
                else:
                    np.testing.assert_allclose(got, explicit_tsim(a[name]).numpy(), rtol=2e-5,
                                               err_msg=f"{norm} L{layer} {sub} {field}")
        res = analyse(cfg, meas)
        assert res["predicted"] is None and res["band_ratios"] is None
        assert len(res["measured"]["mean"]["attn_resid"]) == cfg.num_layers
        with pytest.raises(ValueError, match="closed forms are for --norm-position post or pre"):
            predicted_increments(cfg, meas)
        if norm == "mix":  # layer 1 Post-Norm (a norm step), layers 2-3 Pre-Norm (none)
            norm_step = np.asarray(res["measured"]["mean"]["attn_norm"])
            assert np.isfinite(norm_step[0]) and np.isnan(norm_step[1:]).all()
            result = _jsonable({"config": dataclasses.asdict(cfg), "num_sequences": 2, "runs": [res]})
            png = plot_init_similarity(result, tmp_path / "fig1_mix.png")
            assert png.stat().st_size > 10_000


@pytest.mark.parametrize("scheme, scaled, multiplier", [("paper", True, 1.0), ("std", True, 3.0),
                                                         ("std", False, 0.5), ("paper", False, 2.0)])
def test_stage1_init_variances_are_the_models(scheme: str, scaled: bool, multiplier: float) -> None:
    """Stage I's init variances are the model's (matrix_std) for every role, scheme and multiplier."""
    cfg = ModelConfig(vocab_size=32, num_layers=6, hidden_size=24, ffn_hidden_size=40, num_attention_heads=4,
                      init_variance=scheme, scaled_output_init=scaled, sublayer_init_multiplier=multiplier,
                      init_method_std=0.03)
    var = init_variances(cfg, MODELS)
    ours = (var.sigma_q2, var.sigma_k2, var.sigma_v2, var.sigma_o2, var.sigma_w1_2, var.sigma_w3_2,
            var.sigma_w2_2, var.sigma_embed2)
    roles = ("q", "k", "v", "wo", "w1", "w3", "w2", "embed")
    assert ours == tuple(matrix_std(cfg, role) ** 2 for role in roles)
