"""The size ladder: every preset's parameter count against an independent closed form, the 7B preset
at Llama-2-7B's 6.74B, the recipes against their sources, and the start-of-run parameter line."""

from __future__ import annotations

import math

import pytest
import torch

from megapost.config.arguments import parse_args
from megapost.config.presets import PRESETS
from megapost.model import ModelConfig, TransformerBlock

SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length")
MODEL_PRESETS = [name for name in PRESETS if name != "tiny-cpu"]


def closed_form(L: int, d: int, f: int, v: int, heads: int, groups: int, pre: bool) -> int:
    """Llama with untied head, no biases: per layer W_Q, W_O (d x d), W_K, W_V (d x groups*d/heads),
    SwiGLU's three d x f matrices and two RMSNorm gains; embedding and head v x d; Pre-Norm's final norm."""
    kv = groups * (d // heads)
    layer = d * d + d * kv + d * kv + d * d + d * f + d * f + f * d + d + d
    return L * layer + v * d + d * v + (d if pre else 0)


def preset_config(name: str, norm: str = "pre", vocab: int = 32000, **kw: object) -> ModelConfig:
    shape = {k: PRESETS[name][k] for k in SHAPE_KEYS}
    return ModelConfig(vocab_size=vocab, norm_position=norm, **shape, **kw)


def test_llama_7b_is_llama2_7b() -> None:
    p = PRESETS["llama-7b"]
    assert (p["num_layers"], p["hidden_size"], p["ffn_hidden_size"], p["num_attention_heads"]) == (
        32, 4096, 11008, 32)
    assert preset_config("llama-7b").num_parameters() == 6_738_415_616  # HF Llama-2-7b-hf, untied head
    assert round(preset_config("llama-7b", "post").num_parameters() / 1e9, 2) == 6.74
    # Llama-2 Sec. 2.2: lr 3e-4, cosine to 10%, 2000 warmup, 4M-token batch at seq 4096
    assert (p["lr"], p["min_lr"], p["lr_warmup_iters"], p["seq_length"]) == (3e-4, 3e-5, 2000, 4096)
    assert p["global_batch_size"] * p["seq_length"] == 4 * 2**20


@pytest.mark.parametrize("name", MODEL_PRESETS)
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_preset_counts_match_closed_form(name: str, norm: str) -> None:
    p = PRESETS[name]
    cfg = preset_config(name, norm)
    want = closed_form(p["num_layers"], p["hidden_size"], p["ffn_hidden_size"], 32000,
                       p["num_attention_heads"], p["num_attention_heads"], norm == "pre")
    assert cfg.num_parameters() == want
    assert cfg.num_parameters(non_embedding=True) == want - 2 * 32000 * p["hidden_size"]
    with torch.device("meta"):  # the real block's parameters, without allocating or initialising them
        block = TransformerBlock(cfg, 1)
    assert cfg.parameter_split()["layers"] == p["num_layers"] * sum(t.numel() for t in block.parameters())


@pytest.mark.parametrize("name", [n for n in MODEL_PRESETS if n.startswith("llama-")])
def test_ladder_recipe(name: str) -> None:
    """SwiGLU width per Llama's rule, head dim 64/128, min lr 10%, Chinchilla's 20 tokens/parameter."""
    p = PRESETS[name]
    d = p["hidden_size"]
    assert p["ffn_hidden_size"] % 256 == 0 and 0 <= p["ffn_hidden_size"] - 8 * d / 3 < 256
    assert d // p["num_attention_heads"] in (64, 128)
    assert math.isclose(p["min_lr"], p["lr"] / 10)
    tokens = p["train_iters"] * p["global_batch_size"] * p["seq_length"]
    n = preset_config(name).num_parameters()
    assert 20 * n <= tokens < 20 * n + p["global_batch_size"] * p["seq_length"]
    assert p["lr_warmup_iters"] < p["train_iters"] // 10
    assert p["global_batch_size"] % p["micro_batch_size"] == 0


def test_ladder_sizes_increase_and_depth_series_keeps_the_paper_width() -> None:
    sizes = [preset_config(n).num_parameters() for n in ("paper-180m", "llama-350m", "llama-760m",
                                                         "llama-1.3b", "llama-3b", "llama-7b")]
    assert sizes == sorted(sizes)
    assert [round(s / 1e9, 2) for s in sizes] == [0.2, 0.37, 0.78, 1.36, 2.7, 6.74]
    for n in (12, 24, 48, 96):
        depth = PRESETS[f"paper-depth-{n}"]
        assert depth == {**PRESETS["paper-180m"], "num_layers": n}
    assert preset_config("paper-180m", "post").num_parameters() == 196_395_008


def test_gqa_counts_and_flops() -> None:
    cfg = preset_config("llama-7b", num_query_groups=8)  # Llama-3-8B-style 8 K/V heads at the 7B shape
    assert cfg.num_parameters() == closed_form(32, 4096, 11008, 32000, 32, 8, True)
    mha = preset_config("llama-7b")
    saved = 32 * 2 * 4096 * (4096 - 8 * 128)  # the K and V columns that GQA removes
    assert mha.num_parameters() - cfg.num_parameters() == saved
    assert mha.flops_per_token() - cfg.flops_per_token() == 6 * saved


def test_preset_flags_and_explicit_override() -> None:
    args = parse_args(["--preset", "llama-1.3b", "--lr", "1e-4", "--num-query-groups", "4"])
    assert (args.num_layers, args.hidden_size, args.lr, args.min_lr) == (24, 2048, 1e-4, 2e-5)
    assert args.num_query_groups == 4 and args.norm_position == "post"  # placement stays its own flag


def test_parameter_summary_line() -> None:
    line = preset_config("llama-7b").parameter_summary()
    assert line == "6738.42M parameters (262.14M embedding + head, 6476.27M non-embedding)"
    assert preset_config("llama-7b", num_query_groups=8).parameter_summary().endswith(", GQA 8 K/V heads")
