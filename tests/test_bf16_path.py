"""The bf16 fast path: blocked cross-entropy and native-dtype RMSNorm equal the fp32 reference math,
and the generated DeepSpeed config keeps fp32 accumulation and fp32 gradient reduction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapost.config.arguments import parse_args
from megapost.config.resolved import engine_config
from megapost.model import lm_loss
from megapost.model import loss as loss_mod
from megapost.model.norm import RMSNorm
from megapost.optim.ds_config import build_ds_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_blocked_cross_entropy_equals_torch(dtype, monkeypatch) -> None:
    monkeypatch.setitem(loss_mod.BLOCK_ELEMENTS, "cpu", 3 * 97)  # several blocks, a ragged last one
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 13, 97, generator=gen)).to(dtype)
    labels = torch.randint(0, 97, (2, 13), generator=gen)
    mask = (torch.rand(2, 13, generator=gen) > 0.3).float()
    wide = torch.promote_types(dtype, torch.float32)
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = lm_loss(ours, labels, mask)
    ce = F.cross_entropy(ref.to(wide).flatten(0, 1), labels.flatten(), reduction="none")
    want = (ce * mask.flatten()).sum() / mask.sum()
    got.backward()
    want.backward()
    assert got.dtype == wide
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=tol)
    assert ours.grad.dtype == dtype
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(ours.grad.double(), ref.grad.double(), rtol=grad_tol, atol=grad_tol * 1e-2)


def test_rms_norm_in_bf16_equals_upcast_math() -> None:
    gen = torch.Generator().manual_seed(0)
    x0 = (3 * torch.randn(2, 16, 64, generator=gen)).bfloat16()
    g = torch.randn(2, 16, 64, generator=gen).bfloat16()
    norm = RMSNorm(64).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    x, xr = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    y = norm(x)
    yr = F.rms_norm(xr.float(), (64,), w.float(), 1e-5).to(torch.bfloat16)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad) and torch.equal(norm.weight.grad, w.grad)


def test_bf16_config_keeps_fp32_accumulation_and_reduction() -> None:
    args = parse_args(["--bf16", "--data-path", "x", "--tokenizer-model", "x", "--micro-batch-size", "2",
                       "--global-batch-size", "4"])
    args.grad_accum_steps, args.data_parallel_size = 2, 1
    engine = engine_config(args, "cpu")
    config = build_ds_config(engine, {})
    assert config["zero_optimization"]["stage"] == 1 and config["data_types"]["grad_accum_dtype"] == "fp32"
    assert config["communication_data_type"] == "fp32" and config["bf16"]["immediate_grad_update"]
    user = build_ds_config(engine, {"communication_data_type": "bf16",
                                  "bf16": {"immediate_grad_update": False}})
    assert user["communication_data_type"] == "bf16" and not user["bf16"]["immediate_grad_update"]
