"""The Triton residual add + RMSNorm (megapost.kernels.triton_norm, ``--kernel-fusion`` norm on CUDA) run
on CPU tensors in Triton's interpreter, against autograd's graph of ``x * scale + h`` and torch's
``F.rms_norm``: the forward and every gradient, fp32 and bf16, alone and inside Post-Norm and Pre-Norm
models; one dispatched op each way; the path chosen in one place.

``TRITON_INTERPRET=1`` is set per test (conftest.py's ``interpreter`` fixture, undone after it): Triton
reads it when a kernel is defined, and triton_norm defines its kernels per state of it (and uses none of
triton.language's own jitted helpers, which are fixed at its import). The interpreter casts
fp32 to bf16 by truncation (and its "rtne" mode does not carry into the exponent); a GPU rounds to
nearest even, as torch does, so the fixture gives the interpreter torch's cast for that one conversion,
and numpy's sum for the kernels' sums (as the interpreter does for ``tl.sum``; else a Python loop)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _model_step as model_step

from megapost.kernels import norm_path, rope, triton_add_rms_norm, triton_common, triton_rope, triton_rope_qkv
from megapost.model import LlamaModel, ModelConfig
from megapost.model.fusion import parse_fusion, set_kernel_fusion
from megapost.model.norm import RMSNorm
from megapost.model.rope import apply_rope_tables, rope_cache, rope_tables
from megapost.utils.op_count import count_ops

# a dev dependency on Linux (pyproject.toml); no wheel elsewhere
triton = __import__("triton") if sys.platform == "linux" else pytest.importorskip("triton")

# fp32: max |fused - unfused| <= 1e-6 * max |unfused| (measured <= 1.7e-7: only the reductions' order
# differs); bf16: y exactly (the same two roundings), the rest within one bf16 ulp of the largest value,
# 2^-7 (measured <= 1.4e-3: an fp32 sum's order can move a rounding by one ulp)
TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
# (rows..., hidden): a row tile and the last tile partial; hidden not a power of two; several backward
# programs each striding over several tiles (the dg partials)
SHAPES = [(3, 5, 48), (7, 96), (37, 200), (2, 50, 320), (130, 512)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _run(fused: bool, shape: tuple[int, ...], dtype: torch.dtype, scale: float, add: bool,
         reader: bool) -> list[torch.Tensor]:
    """[y, out, dx, dh, dg] (y, dh: with ``add``); ``reader``: y also feeds a later op (Pre-Norm)."""
    gen = torch.Generator().manual_seed(sum(shape))
    x, h, go, gy = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(4))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    x, h, w = (t.requires_grad_() for t in (x, h, w))
    if fused:
        res = triton_add_rms_norm(x, h if add else None, w, 1e-5, scale)
        y, out = res if add else (x, res)
    else:
        y = (x + h if scale == 1.0 else x * scale + h) if add else x
        out = F.rms_norm(y, [shape[-1]], w, 1e-5)
    if reader and add:
        torch.autograd.backward([out, y * 0.5], [go, gy])
    else:
        out.backward(go)
    return [y.detach(), out.detach(), x.grad, h.grad if add else x.grad, w.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale, add, reader", [(1.0, True, False), (1.7, True, True), (1.0, False, False)])
def test_triton_add_rms_norm_matches_the_unfused_path(interpreter: None, dtype: torch.dtype,
                                                      shape: tuple[int, ...], scale: float, add: bool,
                                                      reader: bool) -> None:
    got = _run(True, shape, dtype, scale, add, reader)
    want = _run(False, shape, dtype, scale, add, reader)
    assert all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(got, want, strict=True))
    assert torch.equal(got[0], want[0])
    for name, a, b in zip(["out", "dx", "dh", "dg"], got[1:], want[1:], strict=True):
        assert _rel(a, b) <= TOL[dtype], (name, _rel(a, b))


@pytest.mark.parametrize("add", [True, False])
def test_triton_add_rms_norm_takes_strided_inputs(interpreter: None, add: bool) -> None:
    """A transposed input (its rows not contiguous), with and without the add: as on contiguous copies."""
    gen = torch.Generator().manual_seed(5)
    x, h = (torch.randn(40, 6, generator=gen).t() for _ in range(2))
    w, go = torch.randn(40, generator=gen), torch.randn(6, 40, generator=gen)
    results = []
    for inputs in ((x, h), (x.contiguous(), h.contiguous())):
        xs, hs, ws = (t.clone().requires_grad_() for t in (*inputs, w))
        res = triton_add_rms_norm(xs, hs if add else None, ws, 1e-5)
        (res[1] if add else res).backward(go)
        results.append([(res[1] if add else res).detach(), xs.grad, ws.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _cfg(placement: str) -> ModelConfig:
    return ModelConfig(vocab_size=96, num_layers=3, hidden_size=40, ffn_hidden_size=96, num_attention_heads=4,
                       seq_length=16, norm_position=placement)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("placement, adds", [("post", 6), ("pre", 3)])
def test_a_model_with_the_triton_norm_matches_unfused(interpreter: None, dtype: torch.dtype, tol: float,
                                                      placement: str, adds: int) -> None:
    """Post-Norm: both adds of each layer run the kernel; Pre-Norm: the attention's add with the FFN's
    input norm (the FFN's add has no norm after it). Logits and every gradient."""
    cfg = _cfg(placement)
    ops = count_ops(lambda: model_step(cfg, "norm", dtype))
    assert ops.by_name["megapost.add_rms_norm"] == ops.by_name["megapost.add_rms_norm_backward"] == adds
    want, want_g = model_step(cfg, "none", dtype)
    got, got_g = model_step(cfg, "norm", dtype)
    assert _rel(got, want) <= tol
    for a, b in zip(got_g, want_g, strict=True):
        assert _rel(a, b) <= tol


def test_one_op_each_way(interpreter: None) -> None:
    """One op forward, one backward (its two kernels, the gradients and the dg partials' sum, inside)."""
    x, h = (torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    fwd = count_ops(lambda: triton_add_rms_norm(x, h, w, 1e-5)[1].sum())
    assert fwd.by_name["megapost.add_rms_norm"] == 1 and fwd.compute == 2  # and the test's sum
    _, out = triton_add_rms_norm(x, h, w, 1e-5)
    grad = torch.ones_like(out)
    bwd = count_ops(lambda: out.backward(grad))
    # copy_: x and h are leaves sharing one gradient tensor (dx = dh), as under an unfused add
    assert dict(bwd.by_name) == {"megapost.add_rms_norm_backward": 1, "aten.copy_": 1}


def test_the_path_is_chosen_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert os.environ.get("TRITON_INTERPRET") is None  # the fixture left nothing on
    assert norm_path(cpu) == "function" and norm_path(cuda) == "triton"
    monkeypatch.setattr(triton_common, "available", lambda: None)
    assert norm_path(cuda) == "torch" and norm_path(cpu) == "function"
    assert "does not import" in triton_common.triton_note(cuda, ["norm", "rope"])


def test_without_triton_the_norm_runs_unfused(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Triton does not import (here: the interpreter's device without it) RMSNorm adds, then runs
    torch's norm: bit-identical to the unfused graph, no megapost op."""
    monkeypatch.setattr(triton_common, "available", lambda: None)
    norm = RMSNorm(64)
    norm.fusion = parse_fusion("norm")
    x, h = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    ops = count_ops(lambda: norm(x, h))
    y, out = norm(x, h)
    assert "megapost.add_rms_norm" not in ops.by_name
    assert torch.equal(out, F.rms_norm(x + h, [64], norm.weight, norm.eps))


def test_auto_runs_the_triton_norm_only_below_fp32(interpreter: None) -> None:
    """Not bit-identical, so "auto" keeps fp32 on torch's kernels; an explicit list forces it."""
    model = LlamaModel(_cfg("post"))
    tokens = torch.randint(0, 96, (2, 16))
    for spec, dtype, runs in [("auto", torch.float32, 0), ("norm", torch.float32, 6),
                              ("auto", torch.bfloat16, 6)]:
        set_kernel_fusion(model.to(dtype), parse_fusion(spec))
        assert count_ops(lambda m=model: m(tokens)).by_name["megapost.add_rms_norm"] == runs, (spec, dtype)


def _rope_inputs(layout: str, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(x, cos, signed_sin, grad): "packed": q and k of a packed Q/K/V GEMM's output, [b, s, heads +
    groups, d] (a strided view), tables [s, 1, d]; "heads": [b, heads, s, d] (a transposed view),
    tables [s, d]. 3 x 7 x 5 = 105 rows: not a multiple of the row tile."""
    gen = torch.Generator().manual_seed(dim)
    b, s, h = 3, 7, 5
    cos, sin = rope_cache(s, dim, 10000.0, torch.device("cpu"))
    cos, ssin = rope_tables(cos, sin, dtype)
    if layout == "packed":
        qkv = torch.randn(b, s, h + 2, dim, generator=gen).to(dtype)
        x, _ = qkv.split((h, 2), dim=2)
        cos, ssin = cos.unsqueeze(1), ssin.unsqueeze(1)
    else:
        x = torch.randn(b, s, h, dim, generator=gen).to(dtype).transpose(1, 2)
    return x, cos, ssin, torch.randn(x.shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["packed", "heads"])
@pytest.mark.parametrize("dim", [64, 48, 128])
def test_triton_rope_matches_the_fused_and_unfused_rope(interpreter: None, dtype: torch.dtype, layout: str,
                                                        dim: int) -> None:
    """Against megapost's RoPE Function (the path it replaces on CUDA; the same roundings) and autograd's
    graph of the unfused expression: the rotation and its gradient."""
    x, cos, ssin, grad = _rope_inputs(layout, dim, dtype)
    results = []
    for fn in (triton_rope, rope, apply_rope_tables):
        xs = x.detach().clone().requires_grad_()
        y = fn(xs, cos, ssin)
        y.backward(grad)
        results.append((y.detach(), xs.grad))
    (y, dx), (want_y, want_dx), (plain_y, plain_dx) = results
    assert y.shape == want_y.shape and dx.dtype == want_dx.dtype
    if dtype == torch.bfloat16:  # the same roundings (fp32 here: CPU's addcmul fuses its multiply-add)
        assert torch.equal(y, want_y) and torch.equal(dx, want_dx)
    assert _rel(y, plain_y) <= TOL[dtype] and _rel(dx, plain_dx) <= TOL[dtype]
    assert _rel(y, want_y) <= TOL[dtype] and _rel(dx, want_dx) <= TOL[dtype]


@pytest.mark.parametrize("nq, nk", [(3, 3), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rope_qkv_equals_split_and_rope(interpreter: None, nq: int, nk: int,
                                               dtype: torch.dtype) -> None:
    """From the packed Q/K/V output: q, k rotated and v as split + ``triton_rope`` give them, bit for bit;
    the packed gradient from SDPA-layout (transposed) output gradients, bit for bit, in one op."""
    gen = torch.Generator().manual_seed(nq)
    b, s, d = 2, 7, 48
    qkv = torch.randn(b, s, nq + 2 * nk, d, generator=gen).to(dtype)
    cos, sin = rope_cache(s, d, 10000.0, torch.device("cpu"))
    cos, ssin = (t.unsqueeze(1) for t in rope_tables(cos, sin, dtype))
    grads = [torch.randn(b, n, s, d, generator=gen).to(dtype) for n in (nq, nk, nk)]  # [b, heads, s, d]

    def run(fused: bool) -> tuple[list[torch.Tensor], torch.Tensor, object]:
        x = qkv.clone().requires_grad_()
        if fused:
            outs = triton_rope_qkv(x, nq, nk, cos, ssin)
        else:
            qk, v = x.split((nq + nk, nk), dim=2)
            outs = [*triton_rope(qk, cos, ssin).split((nq, nk), dim=2), v]
        outs = [t.transpose(1, 2) for t in outs]
        ops = count_ops(lambda: torch.autograd.backward(outs, grads))
        return [t.detach() for t in outs], x.grad, ops

    (got, got_dx, ops), (want, want_dx, _) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and torch.equal(got_dx, want_dx)
    assert dict(ops.by_name) == {"megapost.rope_qkv_backward": 1}


@pytest.mark.parametrize("kw, calls", [({}, 1), ({"qk_norm": True}, 2)])
def test_a_model_with_the_triton_rope_matches_unfused(interpreter: None, kw: dict, calls: int) -> None:
    """bf16 under auto: q and k rotated by one call on the packed GEMM's output per layer, its backward one
    op writing the packed gradient; where qk-norm unpacks them, q and k one call each way
    each; logits and every gradient as with the unfused path."""
    cfg = ModelConfig(**{**_cfg("post").__dict__, **kw})
    ops = count_ops(lambda: model_step(cfg, "auto", torch.bfloat16))
    packed = calls == 1
    assert ops.by_name["megapost.rope"] == (1 if packed else 4) * cfg.num_layers
    assert ops.by_name["megapost.rope_qkv_backward"] == (cfg.num_layers if packed else 0)
    want, want_g = model_step(cfg, "none", torch.bfloat16)
    got, got_g = model_step(cfg, "auto", torch.bfloat16)
    assert _rel(got, want) <= 2e-2 and all(_rel(a, b) <= 2e-2 for a, b in zip(got_g, want_g, strict=True))
    ops = count_ops(lambda: model_step(cfg, "auto", torch.float32))
    assert "megapost.rope" not in ops.by_name  # not bit-identical: fp32 keeps the Function
