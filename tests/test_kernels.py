"""The fused kernels (megapost.kernels, --kernel-fusion) against the unfused path: bit-identical where
the docs say so (RoPE, SwiGLU gate, fp32 gradient accumulation; the default "auto" model in fp32),
within a stated tolerance otherwise (packed GEMMs: fp32 rel 1e-5, bf16 rel 2e-2), with fewer ops
(counted), the packed Q/K/V of a tensor-parallel rank holding its own heads, and activation
checkpointing walking each segment's modules once."""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

from megapost.kernels import packed_linear, packed_weight, rope, swiglu_packed
from megapost.model import LlamaModel, ModelConfig
from megapost.model.attention import Attention
from megapost.model.fusion import Fusion, parse_fusion, set_kernel_fusion
from megapost.model.rope import apply_rope_tables, rope_cache, rope_tables
from megapost.utils.op_count import count_ops

ALL = "rope,qkv,w13,swiglu,grad-accum"


def _grads(fn, *inputs: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rope_is_bit_identical_to_the_autograd_expression(dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    cos, ss = rope_tables(*rope_cache(12, 16, 10000.0, torch.device("cpu")), dtype)
    shape = (2, 3, 12, 16) if layout == "bhsd" else (2, 12, 3, 16)
    if layout == "bshd":
        cos, ss = cos.unsqueeze(1), ss.unsqueeze(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    want = _grads(lambda t: apply_rope_tables(t, cos, ss), x, grad=g)
    got = _grads(lambda t: rope(t, cos, ss), x, grad=g)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rope_dispatches_fewer_ops() -> None:
    cos, ss = rope_tables(*rope_cache(8, 16, 10000.0, torch.device("cpu")), torch.float32)
    x = torch.randn(2, 3, 8, 16, requires_grad=True)

    def step(fn) -> None:
        fn(x, cos, ss).sum().backward()

    fused, plain = count_ops(step, rope).by_name, count_ops(step, apply_rope_tables).by_name
    fused_n, plain_n = sum(fused.values()), sum(plain.values())
    # both: sum + its backward (ones_like/expand) around the rotation; fused rotation 3 fwd + 4 bwd
    assert fused_n <= plain_n - 4, (fused, plain)
    assert "aten.slice_backward" not in fused and plain["aten.slice_backward"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_packed_is_bit_identical_to_silu_times_gate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(3, 5, 2 * 24, generator=gen).to(dtype)
    g = torch.randn(3, 5, 24, generator=gen).to(dtype)
    want = _grads(lambda t: F.silu(t[..., :24]) * t[..., 24:], h, grad=g)
    got = _grads(swiglu_packed, h, grad=g)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("adjacent", [True, False])
def test_packed_linear_matches_separate_linears(dtype: torch.dtype, tol: float, adjacent: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(64 + 32 + 32, 48, generator=gen).to(dtype)
    ws = list(flat.split((64, 32, 32))) if adjacent else [w.clone() for w in flat.split((64, 32, 32))]
    x = torch.randn(2, 7, 48, generator=gen).to(dtype)
    g = torch.randn(2, 7, 128, generator=gen).to(dtype)
    want = _grads(lambda t, *w: torch.cat([F.linear(t, wi) for wi in w], -1), x, *ws, grad=g)
    got = _grads(lambda t, *w: packed_linear(t, w), x, *ws, grad=g)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= tol
    assert (packed_weight(ws).data_ptr() == flat.data_ptr()) == adjacent  # zero-copy only when adjacent


def _tiny(**kw) -> ModelConfig:
    base = {"vocab_size": 96, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96,
            "num_attention_heads": 4, "seq_length": 16}
    return ModelConfig(**{**base, **kw})


def _model_step(cfg: ModelConfig, spec: str, dtype: torch.dtype,
                triton: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(dtype)
    set_kernel_fusion(model, parse_fusion(spec, triton))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"num_query_groups": 2}, {"qk_norm": True}, {"norm_position": "pre"}])
def test_auto_model_is_bit_identical_to_unfused_in_fp32(kw: dict) -> None:
    """The golden runs' guarantee: the default changes no fp32 bit (forward and every gradient)."""
    cfg = _tiny(**kw)
    want, want_g = _model_step(cfg, "none", torch.float32)
    got, got_g = _model_step(cfg, "auto", torch.float32)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_g, want_g, strict=True))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kw", [{}, {"num_query_groups": 2}])
def test_all_fusions_match_unfused_within_tolerance(dtype: torch.dtype, tol: float, kw: dict) -> None:
    cfg = _tiny(**kw)
    want, want_g = _model_step(cfg, "none", dtype)
    got, got_g = _model_step(cfg, ALL, dtype)
    assert _rel(got, want) <= tol
    for a, b in zip(got_g, want_g, strict=True):
        assert _rel(a, b) <= tol
    assert not torch.equal(got_g[1], want_g[1]) or dtype == torch.float32  # bf16: the GEMMs did fuse


def test_fused_block_dispatches_fewer_ops() -> None:
    cfg = _tiny()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))

    def count(spec: str) -> dict[str, int]:
        torch.manual_seed(0)
        model = LlamaModel(cfg).to(torch.bfloat16)
        set_kernel_fusion(model, parse_fusion(spec))
        return count_ops(lambda: model(tokens).float().sum().backward()).by_name

    unfused, fused = count("none"), count(ALL)
    # GEMMs per layer: 7 forward + 14 backward unfused; packed Q/K/V and W_1/W_3: 4 + 8. Head: 1 + 2.
    assert unfused["aten.mm"] == 2 * 21 + 3 and fused["aten.mm"] == 2 * 12 + 3
    assert "aten.slice_backward" not in fused  # RoPE's backward builds no zero-filled halves
    assert sum(fused.values()) <= sum(unfused.values()) - 2 * 12, (fused, unfused)


def test_parse_fusion_refuses_unknown_names() -> None:
    assert parse_fusion("auto") == Fusion() and parse_fusion("none").names == frozenset()
    with pytest.raises(ValueError, match="--kernel-fusion: unknown bogus"):
        parse_fusion("rope,bogus")
    with pytest.raises(ValueError, match="add w13"):
        parse_fusion("swiglu")


# ---- gradient-accumulation fusion against DeepSpeed's own hook body -------------------------------
def _fake_bf16_optimizer(n: int) -> SimpleNamespace:
    """The state DeepSpeed's ``BF16_Optimizer._update_hp_grad`` reads, with that method bound to it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = SimpleNamespace(autoep_folding_tp_group=None, param_names={},
                          fp32_groups_gradients=[[torch.zeros(n) for _ in range(2)]],
                          fp32_groups_has_gradients=[[False, False]])
    opt._update_hp_grad = MethodType(BF16_Optimizer._update_hp_grad, opt)
    return opt


def test_grad_accumulation_fusion_is_bit_identical_and_casts_nothing() -> None:
    from megapost.ds_adapter import grad_accum

    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(6, 5, generator=gen).to(torch.bfloat16) for _ in range(3)]
    ref, fused = _fake_bf16_optimizer(30), _fake_bf16_optimizer(30)
    assert grad_accum.install(fused)
    ops = []
    for g in grads:  # three micro-batches into parameter 1 of group 0
        lp = nn.Parameter(torch.zeros(6, 5, dtype=torch.bfloat16))
        lp.grad = g.clone()
        ref._update_hp_grad(lp, 0, 1, False)
        lp.grad = g.clone()
        ops.append(count_ops(fused._update_hp_grad, lp, 0, 1, False).by_name)
        assert lp._hp_grad is fused.fp32_groups_gradients[0][1]
    assert torch.equal(fused.fp32_groups_gradients[0][1], ref.fp32_groups_gradients[0][1])
    assert fused.fp32_groups_has_gradients == ref.fp32_groups_has_gradients == [[False, True]]
    assert all(o == {"aten.add_": 1} for o in ops), ops  # no aten._to_copy (the cast kernel)


# ---- tensor parallelism: each rank's packed Q/K/V holds its own heads --------------------------------
def _tp_attention_check(groups: int) -> float:
    import torch.distributed as dist

    from megapost.model.block import TransformerBlock
    from megapost.parallel import ParallelState
    from megapost.parallel.parallelize import parallelize_block

    group = dist.new_group([0, 1])
    pstate = ParallelState(tp_size=2, tp_rank=dist.get_rank(), tp_group=group)
    cfg = _tiny(num_query_groups=groups)
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 1)
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    set_kernel_fusion(block, parse_fusion("none"))
    want = block(x).detach()
    parallelize_block(block, pstate)
    set_kernel_fusion(block, parse_fusion("rope,qkv,w13,swiglu"))
    assert isinstance(block.attention, Attention)
    got = block(x).detach()
    return _rel(got, want)


@pytest.mark.integration
@pytest.mark.parametrize("groups", [4, 1])
@pytest.mark.integration
def test_packed_qkv_under_tensor_parallelism_matches_the_full_block(groups: int) -> None:
    """MHA (heads split) and GQA with one K/V group (replicated over both ranks)."""
    assert max(run_ranks(_tp_attention_check, 2, groups)) <= 1e-5


# ---- activation checkpointing walks each segment once, not the whole model per segment --------------
def test_checkpointing_walks_only_its_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    from megapost.parallel import ParallelState, build_model

    cfg = _tiny(num_layers=6)
    model, _ = build_model(cfg, ParallelState(), checkpoint_activations=True, checkpoint_num_layers=1)
    per_block = sum(1 for _ in model.layers[0].modules())
    visited = [0]
    original = nn.Module.modules

    def counting(self: nn.Module):
        for m in original(self):
            visited[0] += 1
            yield m

    monkeypatch.setattr(nn.Module, "modules", counting)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    for _ in range(2):
        model(tokens).sum().backward()
    assert visited[0] <= cfg.num_layers * per_block, visited  # each segment walked once, in step 1 only


def test_op_counter_separates_kernels_from_views() -> None:
    x = torch.ones(4, 6)
    ops = count_ops(lambda: (x.view(24).t() + 1).detach().sum())
    assert dict(ops.by_name) == {"aten.add": 1, "aten.sum": 1}
    assert ops.metadata["aten.view"] == 1 and ops.metadata["aten.detach"] == 1
