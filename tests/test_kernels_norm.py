"""The fused residual add + RMSNorm (megapost.kernels.add_rms_norm, ``--kernel-fusion`` norm) against
autograd's graph of ``x + h`` and torch's ``F.rms_norm``: bit-identical forward and backward in fp32 and
bf16, alone, inside every placement's model, with fewer ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _model_step as model_step

from megapost.kernels import add_rms_norm, rms_norm
from megapost.model import LlamaModel, ModelConfig
from megapost.model.fusion import parse_fusion, set_kernel_fusion
from megapost.model.placements import PLACEMENTS
from megapost.utils.op_count import count_ops

D = 64


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, h, go, gy = (torch.randn(2, 5, D, generator=gen).to(dtype) for _ in range(4))
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    return [x, h, w, go, gy]


def _run(fused: bool, scale: float, reader: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """out and the gradients of x, h and the gain; ``reader``: y also feeds a later op (Pre-Norm's
    stream), whose gradient autograd adds to the norm's."""
    x, h, w, go, gy = _inputs(dtype)
    x, h, w = (t.requires_grad_() for t in (x, h, w))
    if fused:
        y, out = add_rms_norm(x, h, w, 1e-5, scale)
    else:
        y = x + h if scale == 1.0 else x * scale + h
        out = F.rms_norm(y, [D], w, 1e-5)
    if reader:
        torch.autograd.backward([out, y * 0.5], [go, gy])
    else:
        out.backward(go)
    return [out.detach(), x.grad, h.grad, w.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1.7])
@pytest.mark.parametrize("reader", [False, True])
def test_add_rms_norm_is_bit_identical_to_add_then_rms_norm(dtype: torch.dtype, scale: float,
                                                            reader: bool) -> None:
    got, want = _run(True, scale, reader, dtype), _run(False, scale, reader, dtype)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_rms_norm_alone_is_bit_identical_in_bf16() -> None:
    x, _, w, go, _ = _inputs(torch.bfloat16)
    results = []
    for fn in (lambda t, g: rms_norm(t, g, 1e-5), lambda t, g: F.rms_norm(t, [D], g, 1e-5)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws)
        out.backward(go)
        results.append([out.detach(), xs.grad, ws.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _model_step(placement: str, spec: str, dtype: torch.dtype, qk_norm: bool = False) -> list[torch.Tensor]:
    cfg = ModelConfig(vocab_size=96, num_layers=3, hidden_size=D, ffn_hidden_size=96, num_attention_heads=4,
                      seq_length=16, norm_position=placement, qk_norm=qk_norm)
    logits, grads = model_step(cfg, spec, dtype)
    return [logits, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement, qk_norm", [(p, False) for p in PLACEMENTS] + [("post", True)])
def test_every_placement_is_bit_identical_with_the_fused_norm(placement: str, qk_norm: bool,
                                                              dtype: torch.dtype) -> None:
    got, want = _model_step(placement, "norm", dtype, qk_norm), _model_step(placement, "none", dtype, qk_norm)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("placement, saved", [("post", 6), ("pre", 6)])
def test_fused_norm_dispatches_fewer_ops(placement: str, saved: int) -> None:
    """Per layer, bf16: Post-Norm's two add+norms, Pre-Norm's one add+norm and one norm alone, each 4
    3 ops fewer in backward (mean's and pow's full-size detours and rsqrt's scale: 14 ops, not 17)."""
    cfg = ModelConfig(vocab_size=96, num_layers=2, hidden_size=D, ffn_hidden_size=96, num_attention_heads=4,
                      seq_length=16, norm_position=placement)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))

    def count(layers: int, spec: str) -> int:
        torch.manual_seed(0)
        model = LlamaModel(ModelConfig(**{**cfg.__dict__, "num_layers": layers})).to(torch.bfloat16)
        set_kernel_fusion(model, parse_fusion(spec))
        return count_ops(lambda: model(tokens).float().sum().backward()).compute

    per_layer = {spec: count(2, spec) - count(1, spec) for spec in ("none", "norm")}
    assert per_layer["none"] - per_layer["norm"] == saved, per_layer


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_a_probe_sees_the_whole_gradient_of_the_residual_sum(placement: str) -> None:
    """collapse_metrics hooks Y_k's gradient on measured steps: there the block adds and normalises
    unfused, so the hook sees dL/dY whole (the fused Function would keep the norm's part inside)."""
    from megapost.model import set_listener

    def grads(spec: str) -> list[torch.Tensor]:
        cfg = ModelConfig(vocab_size=96, num_layers=2, hidden_size=D, ffn_hidden_size=96,
                          num_attention_heads=4, seq_length=16, norm_position=placement)
        torch.manual_seed(0)
        model = LlamaModel(cfg)
        set_kernel_fusion(model, parse_fusion(spec))
        seen: list[torch.Tensor] = []

        def listener(_name: tuple, **t: torch.Tensor | None) -> None:
            if t.get("y") is not None:
                t["y"].register_hook(seen.append)

        set_listener(model, listener)
        tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        model(tokens).square().mean().backward()
        return seen

    want, got = grads("none"), grads("norm")
    assert len(want) == 4 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
