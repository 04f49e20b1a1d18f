"""Every norm placement (and --qk-norm) against a brute-force re-computation written from its paper's
equations with plain torch ops; the probes' x / y / out / norm_in; DeepNorm's constants and init; the
z-loss; parameter counts. The reference below never calls the block's rule machinery."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_model import manual_attention, manual_ffn, rms

from megapost.model import LlamaModel, ModelConfig, lm_loss, set_listener
from megapost.model.placements import PLACEMENTS

L = 4  # layers: Mix-LN at rho 0.5 has two Post and two Pre layers


def tiny(norm: str, **kw) -> ModelConfig:
    base = dict(vocab_size=97, num_layers=L, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                seq_length=16, norm_position=norm)
    return ModelConfig(**{**base, **kw})


def dyt(x: torch.Tensor, norm) -> torch.Tensor:
    """DyT(x) = g * tanh(a x) (Zhu et al. 2025, no bias)."""
    return norm.weight * torch.tanh(norm.alpha * x)


def reference(model: LlamaModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(logits, {probe name: {x, y, out, norm_in}}) from each paper's equations, placement by placement."""
    cfg = model.config
    p, n_layers = cfg.norm_position, cfg.num_layers
    seen: dict = {}

    def record(name, x, y, out=None, norm_in=None):
        seen[name] = {"x": x, "y": y, "out": out, "norm_in": norm_in}

    x = model.embedding.word_embeddings.weight[tokens]
    if p == "dyt":
        x = x * model.embedding.scale  # the DyT LLaMA models' learned embedding scalar
    seen[("embed",)] = {"x": x}
    for layer, blk in enumerate(model.layers, 1):
        a = blk.attention
        gains = (a.q_norm.weight if a.q_norm is not None else None,
                 a.k_norm.weight if a.k_norm is not None else None,
                 a.v_norm.weight if a.v_norm is not None else None)

        def attn(h, blk=blk, a=a, gains=gains):
            return manual_attention(a, h, head_gains=gains)

        def ffn(h, blk=blk):
            return manual_ffn(blk.mlp, h)

        n1, n2 = blk.attention_norm, blk.mlp_norm
        name_a, name_f = ("layer", layer, "attn"), ("layer", layer, "ffn")
        kind = p
        if p == "mix":  # Mix-LN: Post-Norm in layers 1..floor(rho L), Pre-Norm after
            kind = "post" if layer <= math.floor(cfg.mix_post_fraction * n_layers) else "pre"
        if kind in ("post", "deepnorm"):  # DeepNet: x_{l+1} = LN(alpha x_l + G(x_l)), alpha = (2L)^(1/4)
            alpha = (2 * n_layers) ** 0.25 if kind == "deepnorm" else 1.0
            y1 = alpha * x + attn(x)
            x2 = rms(y1, n1.weight)
            record(name_a, x, y1, x2, y1)
            y2 = alpha * x2 + ffn(x2)
            x = rms(y2, n2.weight)
            record(name_f, x2, y2, x, y2)
        elif kind in ("pre", "pre-scaled"):  # LayerNorm Scaling: x + F(LN(x) / sqrt(l))
            s = 1 / math.sqrt(layer) if kind == "pre-scaled" else 1.0
            y1 = x + attn(s * rms(x, n1.weight))
            record(name_a, x, y1, None, x)
            y2 = y1 + ffn(s * rms(y1, n2.weight))
            record(name_f, y1, y2, None, y1)
            x = y2
        elif kind == "sandwich":  # Peri-LN: x + LN_out(F(LN_in(x)))
            y1 = x + rms(attn(rms(x, n1.weight)), blk.attention_out_norm.weight)
            record(name_a, x, y1, None, x)
            y2 = y1 + rms(ffn(rms(y1, n2.weight)), blk.mlp_out_norm.weight)
            record(name_f, y1, y2, None, y1)
            x = y2
        elif kind == "hybrid":  # HybridNorm: y = x + Attn_QKV-norm(x); z = LN(y); x' = z + FFN(z)
            assert all(g is not None for g in gains[2:]) and n2 is None
            y1 = x + attn(x)
            z = rms(y1, n1.weight)
            record(name_a, x, y1, z, y1)
            x = z + ffn(z)
            record(name_f, z, x)
        elif kind == "dyt":  # Pre-Norm with DyT for every norm; DyT has no RMS factor: norm_in None
            y1 = x + attn(dyt(x, n1))
            record(name_a, x, y1)
            y2 = y1 + ffn(dyt(y1, n2))
            record(name_f, y1, y2)
            x = y2
        else:
            raise AssertionError(p)
    last_is_post = p in ("post", "deepnorm") or (p == "mix" and math.floor(cfg.mix_post_fraction * n_layers)
                                                 == n_layers)
    if not last_is_post:
        x = dyt(x, model.head.final_norm) if p == "dyt" else rms(x, model.head.final_norm.weight)
    seen[("head",)] = {"x": x}
    return model.head.lm_head(x), seen


CASES = [(p, {}) for p in PLACEMENTS] + [(p, {"qk_norm": True}) for p in PLACEMENTS]
CASES += [("mix", {"mix_post_fraction": 1.0}), ("mix", {"mix_post_fraction": 0.0}),
          ("mix", {"mix_post_fraction": 0.3})]


def _perturbed(cfg: ModelConfig) -> LlamaModel:
    model = LlamaModel(cfg)
    with torch.no_grad():  # non-trivial gains (and DyT scalars) so a misplaced norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("norm, kw", CASES, ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
                                                 for p, kw in CASES])
def test_dataflow_and_probes_match_the_papers_equations(norm: str, kw: dict) -> None:
    cfg = tiny(norm, **kw)
    model = _perturbed(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    got: dict = {}
    set_listener(model, lambda name, **t: got.__setitem__(name, t))
    logits = model(tokens)
    with torch.no_grad():
        expected, seen = reference(model, tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    assert got.keys() == seen.keys()
    for name, want in seen.items():
        for key, value in want.items():
            have = got[name].get(key)
            assert (have is None) == (value is None), (name, key)
            if value is not None:
                torch.testing.assert_close(have, value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    assert (model.head.final_norm is not None) == cfg.final_norm
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    has_qk = cfg.qk_norm or norm == "hybrid"
    for blk in model.layers:
        assert (blk.attention.q_norm is not None) == has_qk == (blk.attention.k_norm is not None)
        assert (blk.attention.v_norm is not None) == (norm == "hybrid")


@pytest.mark.parametrize("rho, post_layers, final_norm", [(0.0, 0, True), (0.3, 1, True), (0.5, 2, True),
                                                          (0.75, 3, True), (1.0, 4, False)])
def test_mix_layers_and_final_norm(rho: float, post_layers: int, final_norm: bool) -> None:
    cfg = tiny("mix", mix_post_fraction=rho)
    kinds = [cfg.rules(n)[0].post_norm for n in range(1, L + 1)]
    assert kinds == [True] * post_layers + [False] * (L - post_layers)
    assert cfg.final_norm is final_norm
    assert (LlamaModel(cfg).head.final_norm is not None) is final_norm


@torch.no_grad()
def test_deepnorm_alpha_and_beta_init() -> None:
    """DeepNet decoder-only: alpha = (2L)^(1/4) (checked by the dataflow test's reference), beta =
    (8L)^(-1/4) on W_V, W_O, W_1, W_3, W_2 only; the draws are the same as Post-Norm's."""
    kw = dict(vocab_size=64, num_layers=3, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4)
    deep, post = LlamaModel(ModelConfig(**kw, norm_position="deepnorm")), LlamaModel(ModelConfig(**kw))
    beta = 24 ** -0.25  # (8 * 3)^(-1/4)
    for blk_d, blk_p in zip(deep.layers, post.layers, strict=True):
        for name in ("wq", "wk", "wv", "wo"):
            w_d, w_p = getattr(blk_d.attention, name).weight, getattr(blk_p.attention, name).weight
            assert torch.allclose(w_d, w_p * (beta if name in ("wv", "wo") else 1.0), rtol=1e-6, atol=0), name
        for name in ("w1", "w3", "w2"):
            w_d, w_p = getattr(blk_d.mlp, name).weight, getattr(blk_p.mlp, name).weight
            assert torch.allclose(w_d, w_p * beta, rtol=1e-6, atol=0), name
        std = {n: float(getattr(blk_d.attention, n).weight.detach().std()) for n in ("wq", "wk", "wv", "wo")}
        std |= {n: float(getattr(blk_d.mlp, n).weight.detach().std()) for n in ("w1", "w3", "w2")}
        assert abs(std["wv"] / std["wq"] / beta - 1) < 0.03 and abs(std["wk"] / std["wq"] - 1) < 0.03
        assert abs(std["w1"] / std["wq"] / beta - 1) < 0.03 and abs(std["w3"] / std["wq"] / beta - 1) < 0.03
        # W_O and W_2 also carry Megatron's 1/sqrt(2L) output scaling
        assert abs(std["wo"] / std["wq"] / beta * math.sqrt(6) - 1) < 0.03
        assert abs(std["w2"] / std["wq"] / beta * math.sqrt(6) - 1) < 0.03
    assert deep.head.final_norm is None


def test_dyt_initial_values_and_no_rms_norm() -> None:
    cfg = tiny("dyt")
    model = LlamaModel(cfg)
    assert float(model.embedding.scale.detach()) == pytest.approx(math.sqrt(cfg.hidden_size))
    for blk in model.layers:
        assert float(blk.attention_norm.alpha.detach()) == pytest.approx(0.8)
        assert float(blk.mlp_norm.alpha.detach()) == pytest.approx(0.2)
        torch.testing.assert_close(blk.attention_norm.weight, torch.ones(cfg.hidden_size))
    assert float(model.head.final_norm.alpha.detach()) == pytest.approx(0.2)
    other = LlamaModel(tiny("dyt", dyt_alpha_init=(0.5, 0.1))).layers[0]
    alphas = (float(other.attention_norm.alpha.detach()), float(other.mlp_norm.alpha.detach()))
    assert alphas == pytest.approx((0.5, 0.1))
    assert not any(type(m).__name__ == "RMSNorm" for m in model.modules())


@pytest.mark.parametrize("norm, kw", [("post", {}), ("sandwich", {"qk_norm": True}), ("dyt", {}),
                                      ("hybrid", {})])
def test_parameter_names_per_placement(norm: str, kw: dict) -> None:
    """The norm modules each placement owns, by name (what checkpoints and HF export see)."""
    names = {n for n, _ in LlamaModel(tiny(norm, num_layers=1, **kw)).named_parameters()
             if "norm" in n or "scale" in n}
    want = {
        "post": {"layers.0.attention_norm.weight", "layers.0.mlp_norm.weight"},
        "sandwich": {"layers.0.attention_norm.weight", "layers.0.mlp_norm.weight",
                     "layers.0.attention_out_norm.weight", "layers.0.mlp_out_norm.weight",
                     "layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight",
                     "head.final_norm.weight"},
        "dyt": {f"{m}.{p}" for m in ("layers.0.attention_norm", "layers.0.mlp_norm", "head.final_norm")
                for p in ("weight", "alpha")} | {"embedding.scale"},
        "hybrid": {"layers.0.attention_norm.weight", "layers.0.attention.q_norm.weight",
                   "layers.0.attention.k_norm.weight", "layers.0.attention.v_norm.weight",
                   "head.final_norm.weight"},
    }[norm]
    assert names == want


def _logits_labels_mask(v: int = 41) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, v, generator=gen) * 5 + 2  # log Z far from 0, so the z-loss matters
    labels = torch.randint(0, v, (3, 7), generator=gen)
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    return logits, labels, mask


def naive_z_loss_objective(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                           coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, CE + coef * mean(log^2 Z)) over the mask, PaLM's z-loss written out."""
    ce = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="none")
    lse = torch.logsumexp(logits.flatten(0, 1).double(), dim=-1)
    m = mask.flatten().double()
    plain = (ce * m).sum() / m.sum()
    return plain, plain + coef * (lse.square() * m).sum() / m.sum()


def test_z_loss_gradient_only() -> None:
    logits, labels, mask = _logits_labels_mask()
    coef = 1e-2
    ref_logits = logits.clone().requires_grad_(True)
    plain, objective = naive_z_loss_objective(ref_logits, labels, mask, coef)
    objective.backward()
    ours = logits.clone().requires_grad_(True)
    loss = lm_loss(ours, labels, mask, z_loss=coef)
    loss.backward()
    torch.testing.assert_close(loss.double(), plain.detach(), rtol=1e-6, atol=1e-6)  # the value: plain CE
    torch.testing.assert_close(ours.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    without = logits.clone().requires_grad_(True)
    lm_loss(without, labels, mask).backward()
    assert float((without.grad - ours.grad).abs().max()) > 1e-3  # the z-loss term is really there


def _train_losses(model: LlamaModel, steps: int = 4) -> list[float]:
    cfg = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=gen)
    losses = []
    for _ in range(steps):  # one batch again and again: the loss must fall
        loss = lm_loss(model(seq[:, :-1]), seq[:, 1:], torch.ones(4, cfg.seq_length), z_loss=1e-4)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("norm, kw", [(p, {"qk_norm": p in ("post", "dyt")}) for p in PLACEMENTS],
                         ids=[f"{p}{'-qk' if p in ('post', 'dyt') else ''}" for p in PLACEMENTS])
def test_bf16_trains_like_fp32(norm: str, kw: dict) -> None:
    """A few steps with bf16 weights and activations (norms and the loss compute in fp32 inside):
    finite losses within 2% of the fp32 run's, and falling."""
    cfg = tiny(norm, num_layers=2, **kw)
    fp32 = _train_losses(LlamaModel(cfg))
    bf16 = _train_losses(LlamaModel(cfg).to(torch.bfloat16))
    assert all(math.isfinite(x) for x in bf16)
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True)) < 2e-2, (bf16, fp32)
    assert bf16[-1] < bf16[0] and fp32[-1] < fp32[0]
