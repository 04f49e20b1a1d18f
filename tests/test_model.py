"""The model: Post vs Pre dataflow against an explicit re-computation, shapes, init variances."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megapost.model import LlamaModel, ModelConfig, lm_loss, set_listener
from megapost.model.attention import causal_running_mean
from megapost.model.init import matrix_std


def tiny(norm: str, **kw) -> ModelConfig:
    base = dict(vocab_size=97, num_layers=3, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                seq_length=16, norm_position=norm)
    return ModelConfig(**{**base, **kw})


def rms(x: torch.Tensor, g: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def manual_attention(attn, x: torch.Tensor, alpha: float = 0.0,
                     head_gains: tuple[torch.Tensor | None, ...] = (None, None, None)) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h)) v W_O with RoPE; ``head_gains`` (g_q, g_k, g_v): RMSNorm of each head
    of q, k, v over its d_h channels before RoPE (None: not normalised)."""
    b, s, d = x.shape
    hd = attn.head_dim
    q, k, v = (lin(x).view(b, s, -1, hd).transpose(1, 2) for lin in (attn.wq, attn.wk, attn.wv))
    q, k, v = (t if g is None else rms(t, g) for t, g in zip((q, k, v), head_gains, strict=True))
    inv = 1.0 / (attn.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    p = scores.softmax(-1)
    if alpha:
        p = p - alpha * torch.tril(torch.ones(s, s)) / torch.arange(1, s + 1).float().unsqueeze(1)
    out = (p @ v).transpose(1, 2).reshape(b, s, d)
    return attn.wo(out)


def manual_ffn(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_dataflow_matches_explicit_equations(norm: str) -> None:
    cfg = tiny(norm)
    model = LlamaModel(cfg)
    with torch.no_grad():  # non-trivial gains so a misplaced norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    x = model.embedding.word_embeddings.weight[tokens]
    for blk in model.layers:
        g1, g2 = blk.attention_norm.weight, blk.mlp_norm.weight
        if norm == "post":
            y1 = x + manual_attention(blk.attention, x)
            x2 = rms(y1, g1)
            y2 = x2 + manual_ffn(blk.mlp, x2)
            x = rms(y2, g2)
        else:
            y1 = x + manual_attention(blk.attention, rms(x, g1))
            y2 = y1 + manual_ffn(blk.mlp, rms(y1, g2))
            x = y2
    if norm == "pre":
        x = rms(x, model.head.final_norm.weight)
    else:
        assert model.head.final_norm is None  # Post-Norm's last block output already is X^H
    expected = model.head.lm_head(x)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-5)


def test_post_and_pre_differ_only_in_norm_placement() -> None:
    post, pre = LlamaModel(tiny("post")), LlamaModel(tiny("pre"))
    pre_params = dict(pre.named_parameters())
    for name, p in post.named_parameters():
        torch.testing.assert_close(p, pre_params[name])  # same seed -> same weights
    assert set(pre_params) - {n for n, _ in post.named_parameters()} == {"head.final_norm.weight"}


def test_shapes_parameter_count_and_loss() -> None:
    cfg = tiny("post")
    model = LlamaModel(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length))
    logits = model(tokens)
    assert logits.shape == (3, cfg.seq_length, cfg.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    mask = torch.ones(3, cfg.seq_length)
    mask[:, :4] = 0
    ce = F.cross_entropy(logits[:, 4:].reshape(-1, cfg.vocab_size), tokens[:, 4:].reshape(-1))
    torch.testing.assert_close(lm_loss(logits, tokens, mask), ce)


@pytest.mark.parametrize("scheme", ["std", "paper"])
def test_init_variances(scheme: str) -> None:
    cfg = ModelConfig(vocab_size=512, num_layers=2, hidden_size=256, ffn_hidden_size=768,
                      num_attention_heads=4, init_variance=scheme, sublayer_init_multiplier=2.0)
    model = LlamaModel(cfg)
    blk = model.layers[0]
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    if scheme == "paper":
        expect = {"wq": 2 / (3 * d), "wo": 2 / (3 * d), "w1": 2 / (3 * d), "w3": 2 / (3 * d),
                  "w2": 2 / (3 * f), "embed": 1 / (3 * d)}
    else:
        s2 = 0.02**2
        expect = {"wq": 2 * s2, "wo": 2 * s2 / (2 * cfg.num_layers), "w1": 2 * s2, "w3": 2 * s2,
                  "w2": 2 * s2 / (2 * cfg.num_layers), "embed": s2}
    weights = {"wq": blk.attention.wq.weight, "wo": blk.attention.wo.weight, "w1": blk.mlp.w1.weight,
               "w3": blk.mlp.w3.weight, "w2": blk.mlp.w2.weight,
               "embed": model.embedding.word_embeddings.weight}
    for name, w in weights.items():
        assert abs(w.var().item() / expect[name] - 1) < 0.05, name
        assert abs(w.mean().item()) < 3 * math.sqrt(expect[name] / w.numel()) + 1e-6
    assert matrix_std(cfg, "head") ** 2 == pytest.approx(expect["embed"])
    torch.testing.assert_close(blk.attention_norm.weight, torch.ones(d))


def test_same_seed_same_weights_any_construction_order() -> None:
    from megapost.model import build_block

    cfg = tiny("post")
    model = LlamaModel(cfg)
    lone = build_block(cfg, 3)  # a pipeline stage building only layer 3
    for (n, a), (_, b) in zip(model.layers[2].named_parameters(), lone.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_prefix_alpha_intervention_matches_explicit_matrix() -> None:
    cfg = tiny("post", prefix_alpha=0.75)
    model = LlamaModel(cfg)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size)
    attn = model.layers[0].attention
    torch.testing.assert_close(attn(x), manual_attention(attn, x, alpha=0.75), rtol=1e-4, atol=1e-5)
    v = torch.randn(5, 7, 3)
    torch.testing.assert_close(causal_running_mean(v)[:, 3], v[:, :4].mean(1))


def test_probes_report_boundaries_and_cost_nothing_when_detached() -> None:
    cfg = tiny("post")
    model = LlamaModel(cfg)
    seen: list[tuple] = []
    assert set_listener(model, lambda name, **t: seen.append((name, sorted(k for k, v in t.items()
                                                                            if v is not None)))) == 8
    model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert seen[0] == (("embed",), ["x"])
    assert seen[1] == (("layer", 1, "attn"), ["norm_in", "out", "x", "y"])
    assert seen[-1] == (("head",), ["x"])
    set_listener(model, None)
    seen.clear()
    model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert not seen
