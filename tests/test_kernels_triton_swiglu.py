"""The Triton SwiGLU gate (megapost.kernels.triton_swiglu, ``--kernel-fusion`` swiglu on CUDA) run on CPU
tensors in Triton's interpreter (conftest.py's ``interpreter`` fixture): against megapost's SwiGLU
Function (the path it replaces) and autograd's graph of ``F.silu(h1) * h3``, the forward and the packed
gradient, fp32 and bf16; inside a model under ``auto``; one op each way; the path chosen in one place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _model_step as model_step
from test_kernels_triton import TOL, _cfg
from test_kernels_triton import _rel as rel

from megapost.kernels import swiglu_packed, swiglu_path, triton_common, triton_swiglu
from megapost.utils.op_count import count_ops

# (rows..., 2f): f not a power of two, f past one column tile (1024), rows not a multiple of a row tile
SHAPES = [(3, 5, 96), (37, 400), (2, 7, 3072)]


def _unfused(h13: torch.Tensor) -> torch.Tensor:
    h1, h3 = h13.chunk(2, dim=-1)
    return F.silu(h1) * h3


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h13, output gradient); ``strided``: both non-contiguous views (transposed storage)."""
    gen = torch.Generator().manual_seed(shape[-1])
    h13 = (2 * torch.randn(*shape, generator=gen)).to(dtype)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype)
    if strided:
        h13, grad = (t.transpose(0, -1).contiguous().transpose(0, -1) for t in (h13, grad))
        assert not h13.is_contiguous()
    return h13, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_triton_swiglu_matches_the_function_and_unfused(interpreter: None, dtype: torch.dtype,
                                                       shape: tuple[int, ...], strided: bool) -> None:
    """The gate and its [dh1 | dh3]: the same roundings as the Function and the unfused graph (bf16:
    within one ulp of the largest value, as an exp may differ in its last fp32 bit; fp32 within 1e-6)."""
    h13, grad = _inputs(shape, dtype, strided)
    results = []
    for fn in (triton_swiglu, swiglu_packed, _unfused):
        h = h13.detach().clone().requires_grad_()
        y = fn(h)
        y.backward(grad)
        results.append((y.detach(), h.grad))
    (y, dh), (want_y, want_dh), (plain_y, plain_dh) = results
    assert y.shape == want_y.shape and dh.shape == h13.shape and dh.dtype == dtype
    for got, want in ((y, want_y), (dh, want_dh), (y, plain_y), (dh, plain_dh)):
        assert rel(got, want) <= TOL[dtype]
    if dtype == torch.bfloat16:  # almost every element identical: the same ops and roundings
        assert (y != want_y).float().mean() <= 1e-3 and (dh != want_dh).float().mean() <= 1e-3


def test_one_op_each_way(interpreter: None) -> None:
    h13 = torch.randn(4, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    y = triton_swiglu(h13)
    fwd = count_ops(lambda: triton_swiglu(h13))
    assert dict(fwd.by_name) == {"megapost.swiglu": 1}
    grad = torch.ones_like(y)
    bwd = count_ops(lambda: y.backward(grad))
    assert dict(bwd.by_name) == {"megapost.swiglu_backward": 1}


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_a_model_with_the_triton_swiglu_matches_unfused(interpreter: None, placement: str) -> None:
    """bf16 under auto: one gate op each way per layer; logits and every gradient as with the unfused
    path. fp32 under auto keeps the Function (not bit-identical); an explicit list forces it."""
    cfg = _cfg(placement)
    ops = count_ops(lambda: model_step(cfg, "auto", torch.bfloat16))
    assert ops.by_name["megapost.swiglu"] == ops.by_name["megapost.swiglu_backward"] == cfg.num_layers
    want, want_g = model_step(cfg, "none", torch.bfloat16)
    got, got_g = model_step(cfg, "auto", torch.bfloat16)
    assert rel(got, want) <= 2e-2 and all(rel(a, b) <= 2e-2 for a, b in zip(got_g, want_g, strict=True))
    assert "megapost.swiglu" not in count_ops(lambda: model_step(cfg, "auto", torch.float32)).by_name
    forced = count_ops(lambda: model_step(cfg, "w13,swiglu", torch.float32))
    assert forced.by_name["megapost.swiglu"] == cfg.num_layers
    want, want_g = model_step(cfg, "none", torch.float32)
    got, got_g = model_step(cfg, "w13,swiglu", torch.float32)
    assert rel(got, want) <= 1e-5 and all(rel(a, b) <= 1e-5 for a, b in zip(got_g, want_g, strict=True))


def test_the_path_is_chosen_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert swiglu_path(cpu) == "function" and swiglu_path(cuda) == "triton"
    monkeypatch.setattr(triton_common, "available", lambda: None)
    assert swiglu_path(cuda) == "function"
    assert "SwiGLU gate run as torch ops" in triton_common.triton_note(cuda, ["swiglu"])


def test_no_triton_kernels_runs_the_torch_paths(interpreter: None) -> None:
    """``--no-triton-kernels`` reaches the model through the trainer's config; there no Triton op runs
    where they otherwise run (bf16 under auto), and the model computes what ``none``'s torch ops do."""
    from megapost.config.arguments import build_parser
    from megapost.config.resolved import _runtime
    from megapost.train.build import kernel_fusion

    def fusion(argv: list[str]) -> object:
        return kernel_fusion(_runtime(build_parser().parse_args(argv)))

    assert fusion(["--no-triton-kernels"]).triton is False and fusion([]).triton is True
    cfg = _cfg("post")
    on = count_ops(lambda: model_step(cfg, "auto", torch.bfloat16)).by_name
    assert all(on[f"megapost.{name}"] > 0 for name in ("add_rms_norm", "rope", "swiglu"))
    off = count_ops(lambda: model_step(cfg, "auto", torch.bfloat16, triton=False)).by_name
    assert not [name for name in off if name.startswith("megapost.")]
