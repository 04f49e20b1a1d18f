"""Grouped-query attention: the model against a brute-force per-head reference, G = heads bit-for-bit
today's MHA, HF Llama equivalence with ``num_key_value_heads``, the flags, and tensor/sequence/pipeline
layouts against the single process."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import (
    RunSpec,
    check_layout_matches_single_process,
    run_ranks,
    synthetic_micro_batch,
    tiny_config,
)

from megapost.config.arguments import parse_args, validate_args
from megapost.config.errors import ConfigError
from megapost.model import LlamaModel, ModelConfig
from megapost.parallel import layout_errors


def tiny(**kw: object) -> ModelConfig:
    base = dict(vocab_size=97, num_layers=2, hidden_size=48, ffn_hidden_size=64, num_attention_heads=6,
                seq_length=16, norm_position="pre", seed=3)
    return ModelConfig(**{**base, **kw})


def brute_force_attention(attn: torch.nn.Module, x: torch.Tensor, groups: int, heads: int,
                          alpha: float = 0.0) -> torch.Tensor:
    """Each query head h against K/V head h // (heads / groups), one head at a time, RoPE by hand."""
    b, s, _ = x.shape
    hd = attn.head_dim
    q, k, v = (lin(x).view(b, s, -1, hd) for lin in (attn.wq, attn.wk, attn.wv))
    assert k.shape[2] == groups
    inv = 1.0 / (attn.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(s).float(), inv).repeat(1, 2)

    def rot(t: torch.Tensor) -> torch.Tensor:
        return t * ang.cos() + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * ang.sin()

    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    outs = []
    for h in range(heads):
        g = h // (heads // groups)
        scores = rot(q[:, :, h]) @ rot(k[:, :, g]).transpose(-1, -2) / math.sqrt(hd)
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        if alpha:
            p = p - alpha * causal.float() / torch.arange(1, s + 1).float().unsqueeze(1)
        outs.append(p @ v[:, :, g])
    return attn.wo(torch.cat(outs, -1))


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_gqa_attention_matches_brute_force(groups: int) -> None:
    cfg = tiny(num_query_groups=groups, prefix_alpha=0.3)
    attn = LlamaModel(cfg).layers[0].attention
    assert attn.wk.weight.shape == attn.wv.weight.shape == (groups * 8, 48)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    want = brute_force_attention(attn, x, groups, 6, alpha=0.3)
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_groups_equal_heads_is_todays_model_bit_for_bit() -> None:
    mha, same = LlamaModel(tiny()), LlamaModel(tiny(num_query_groups=6))
    assert same_weights(mha, same)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(mha(tokens), same(tokens))


def test_gqa_init_draws_full_kv_weights_from_the_layer_stream() -> None:
    """K/V matrices have the layout-invariant init: the same (seed, layer) stream, smaller K/V."""
    a, b = LlamaModel(tiny(num_query_groups=2)), LlamaModel(tiny(num_query_groups=2))
    assert same_weights(a, b)
    mha = LlamaModel(tiny())
    assert torch.equal(a.layers[0].attention.wq.weight, mha.layers[0].attention.wq.weight)
    assert sum(p.numel() for p in a.parameters()) == tiny(num_query_groups=2).num_parameters()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """megapost names -> transformers' Llama names (the mapping lives here, in the test only)."""
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
             "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            module, param = rest.rsplit(".", 1)
            key = f"model.layers.{i}.{names[module]}.{param}"
        else:
            key = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                   "head.final_norm.weight": "model.norm.weight",
                   "head.lm_head.weight": "lm_head.weight"}[key]
        out[key] = value
    return out


@pytest.mark.parametrize("groups", [2, 6])
def test_pre_norm_gqa_equals_transformers_llama(groups: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = tiny(num_query_groups=groups)
    model = LlamaModel(cfg)
    with torch.no_grad():  # non-trivial gains so a misplaced norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    hf_cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=groups, max_position_embeddings=16,
                         rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, hidden_act="silu")
    hf = LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-5)


def _validate(*argv: str) -> None:
    args = parse_args(list(argv))
    validate_args(args, world_size=int(args.tensor_model_parallel_size))


@pytest.mark.parametrize("argv, message", [
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups G"),
    (["--num-query-groups", "3"], "--num-query-groups 3 must divide --num-attention-heads 4"),
    (["--num-attention-heads", "12", "--hidden-size", "192", "--num-query-groups", "6",
      "--tensor-model-parallel-size", "4"], "--num-query-groups 6 and --tensor-model-parallel-size 4: one"),
])
def test_bad_query_groups_fail_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _validate(*argv)
    lines = str(err.value).splitlines()  # every error of the launch, one line each (no data given here)
    assert any(message in line for line in lines) and all(line.startswith("error: ") for line in lines)


def test_layout_check_names_query_groups_and_tp() -> None:
    cfg = tiny(num_attention_heads=12, num_query_groups=6, hidden_size=96, ffn_hidden_size=144,
               vocab_size=144)
    assert any("--num-query-groups 6" in e for e in layout_errors(cfg, 4, 1, False, 16, 4))
    for tp in (1, 2, 3, 6, 12):  # K/V split (6 % tp == 0) or replicated (tp % 6 == 0)
        assert layout_errors(cfg, tp, 1, False, 16, tp) == []


# ----------------------------------------------------------------------------- layouts (2-4 gloo ranks)

def _gqa(tp: int, pp: int, dp: int, groups: int, slow: bool = False, **kw: object) -> object:
    """5 steps, not 10: the layouts agree with one process as closely as MHA does at step 0 (gradient
    norm 6e-8, elementwise gradients 7e-7 of the largest), but this GQA model's AdamW trajectory amplifies
    rounding faster (norms 1e-6 apart by step 5, 1.6e-5 by step 9, against MHA's 5e-7)."""
    spec = RunSpec(tp=tp, pp=pp, steps=5,
                   **{"model": {"norm_position": "pre", "num_query_groups": groups}, **kw})
    name = f"G{groups}-tp{tp}-pp{pp}-dp{dp}" + "".join(f"-{k}" for k in ("sp", "probes") if kw.get(k))
    name += "-ckpt" if kw.get("checkpoint_activations") else ""
    name += f"-zero{kw['zero_stage']}" if "zero_stage" in kw else ""
    return pytest.param(spec, dp, id=name, marks=[pytest.mark.slow] if slow else [])


GQA_LAYOUTS = [
    _gqa(2, 1, 1, groups=2),  # K/V heads split over TP
    _gqa(2, 1, 1, groups=1, sp=True, checkpoint_activations=True, probes=True),  # K/V replicated
    _gqa(1, 2, 1, groups=2, slow=True, probes=True),
    _gqa(2, 2, 1, groups=1, slow=True, sp=True),
    _gqa(2, 1, 2, groups=1, slow=True, zero_stage=2),
    _gqa(2, 1, 1, groups=1, slow=True, optimizer="sgd", lr=0.5),
]


def block_gradients(tp: int, groups: int, sp: bool) -> dict[str, torch.Tensor]:
    """Logits-loss gradients of every full parameter after one forward/backward at TP ``tp`` (per rank)."""
    from megapost.parallel import build_model, full_state_dict, initialize_parallel

    pstate = initialize_parallel(tp, 1, sp)
    cfg = tiny_config(norm_position="pre", num_query_groups=groups)
    model, loss_fn = build_model(cfg, pstate)
    tokens, labels, mask = synthetic_micro_batch(RunSpec(), cfg, 0, 0)
    loss = loss_fn(model(tokens), labels, mask)
    loss.backward()
    counted = [p.grad for p in model.parameters()  # what DeepSpeed's global gradient norm sums here
               if getattr(p, "tensor_model_parallel", False) or pstate.tp_rank == 0]
    with torch.no_grad():
        for p in model.parameters():  # gather the gradients through the parameters' shard tags
            p.copy_(p.grad)
    return {"loss": loss.detach(), "norm_sq": sum(float(g.double().square().sum()) for g in counted),
            **full_state_dict(model, pstate)}


@pytest.mark.integration
def test_replicated_kv_over_two_slots_matches_one_process() -> None:
    """TP 4 with 2 K/V groups (each held by 2 ranks) under sequence parallelism: the loss, every gathered
    gradient (K/V summed within each pair of ranks) and the gradient norm equal the single process's."""
    ref = block_gradients(1, 2, False)
    ranks = run_ranks(block_gradients, 4, 4, 2, True)
    # each replicated K/V slice counts once in the global gradient norm (tagged on its first rank only)
    assert sum(r.pop("norm_sq") for r in ranks) == pytest.approx(ref.pop("norm_sq"), rel=1e-6)
    for out in ranks:
        assert out.keys() == ref.keys()
        for k in ref:
            scale = float(ref[k].abs().max())
            assert float((out[k] - ref[k]).abs().max()) <= 1e-5 * scale, k


@pytest.mark.integration
@pytest.mark.parametrize("spec, dp", GQA_LAYOUTS)
def test_gqa_layout_matches_single_process(spec: RunSpec, dp: int) -> None:
    check_layout_matches_single_process(spec, dp)


@pytest.mark.integration
def test_trainer_runs_gqa_and_prints_the_split(tiny_data) -> None:
    from launch_utils import pretrain, tiny_model_flags

    from megapost.parallel import padded_vocab_size

    out = pretrain(tiny_model_flags(tiny_data, **{"--num-query-groups": 2, "--group-query-attention": True,
                                                  "--train-iters": 2, "--norm-position": "post"}))
    cfg = ModelConfig(vocab_size=padded_vocab_size(tiny_data.vocab_size), num_layers=2, hidden_size=64,
                      ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
    assert f" megapost: {cfg.parameter_summary()}, norm=post" in out.stdout, out.stdout
    assert cfg.parameter_summary().endswith("non-embedding), GQA 2 K/V heads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sdpa_equals_enable_gqa_and_fp32_never_asks_for_it(dtype: torch.dtype, monkeypatch) -> None:
    """fp32 repeats K/V (CUDA has no fused fp32 kernel taking enable_gqa); outputs and gradients equal
    torch's own enable_gqa SDPA; only bf16 passes enable_gqa on."""
    from megapost.model import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 32, 16, generator=gen, dtype=dtype, requires_grad=True) for n in (6, 2, 2))
    real = torch.nn.functional.scaled_dot_product_attention
    want = real(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    calls: list[dict] = []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = attention.grouped_sdpa(q, k, v, 3)
    got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert calls[0].get("enable_gqa", False) is (dtype != torch.float32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **tol)
