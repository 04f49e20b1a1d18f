"""The chunked head + cross-entropy (megapost.kernels.linear_cross_entropy, ``--kernel-fusion`` ce)
against torch's own fp64 cross-entropy and against megapost's unfused head + loss: loss, z-loss and the
gradients of the input and the weight; it never holds the logits (live tensor bytes counted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapost.kernels import linear_ce, linear_cross_entropy
from megapost.metrics.tensor_memory import LiveTensorMemory
from megapost.model import LlamaModel, ModelConfig
from megapost.model.fusion import parse_fusion, set_kernel_fusion
from megapost.model.loss import HeadOutput, lm_loss, masked_lm_loss

N, H, V = 23, 16, 40


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(N, H, generator=gen)).to(dtype)
    w = torch.randn(V, H, generator=gen).to(dtype)
    t = torch.randint(0, V, (N,), generator=gen)
    mask = (torch.rand(N, generator=gen) > 0.3).float()
    return x, w, t, mask


def _reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, mask: torch.Tensor,
               z_loss: float) -> list[torch.Tensor]:
    """torch's cross-entropy in fp64 with autograd: loss value and d(CE + z term)/d(x, w)."""
    x, w = (a.double().requires_grad_() for a in (x, w))
    logits = x @ w.t()
    ce = F.cross_entropy(logits, t, reduction="none")
    lse = torch.logsumexp(logits, -1)
    m = mask.double()
    loss = (ce * m).sum() / m.sum()
    (loss + z_loss * (lse.square() * m).sum() / m.sum()).backward()
    return [loss.detach(), x.grad, w.grad]


def _fused(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, z_loss: float,
           rows: int | None) -> list[torch.Tensor]:
    x, w = (a.clone().requires_grad_() for a in (x, w))
    loss = masked_lm_loss(*linear_cross_entropy(x, w, t, rows), mask, z_loss)
    loss.backward()
    return [loss.detach(), x.grad, w.grad]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("rows", [5, None])
def test_chunked_head_and_loss_match_torch_cross_entropy(dtype: torch.dtype, tol: float, z_loss: float,
                                                         rows: int | None) -> None:
    x, w, t, mask = _data(dtype)
    got = _fused(x, w, t, mask, z_loss, rows)
    want = _reference(x, w, t, mask, z_loss)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= tol, (_rel(a, b), tol)


def test_matches_the_unfused_head_and_loss_in_fp32() -> None:
    """The same ops per row (a GEMM of fewer rows may round differently); dW sums over chunks."""
    x, w, t, mask = _data(torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    plain = lm_loss(F.linear(xs, ws), t, mask, 1e-2)
    plain.backward()
    got = _fused(x, w, t, mask, 1e-2, rows=5)
    for a, b in zip(got, [plain.detach(), xs.grad, ws.grad], strict=True):
        assert _rel(a, b) <= 1e-6


def test_only_log_z_used() -> None:
    x, w, t, _ = _data(torch.float32)
    xs = x.clone().requires_grad_()
    linear_cross_entropy(xs, w, t, 5)[1].sum().backward()
    xr = x.double().requires_grad_()
    torch.logsumexp(xr @ w.double().t(), -1).sum().backward()
    assert _rel(xs.grad, xr.grad) <= 1e-6


def _model_loss(spec: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    cfg = ModelConfig(vocab_size=96, num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      seq_length=16)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(dtype)
    model.head.returns_head_output = True
    set_kernel_fusion(model, parse_fusion(spec))
    gen = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, 96, (2, 16), generator=gen) for _ in range(2))
    out = model(tokens)
    loss = lm_loss(out, labels, torch.ones(2, 16), z_loss=1e-3)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], isinstance(out, HeadOutput)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_model_with_the_chunked_head_matches_unfused(dtype: torch.dtype, tol: float) -> None:
    want, want_g, deferred = _model_loss("none", dtype)
    assert not deferred
    got, got_g, deferred = _model_loss("ce", dtype)
    assert deferred
    assert _rel(got, want) <= tol
    for a, b in zip(got_g, want_g, strict=True):
        assert _rel(a, b) <= tol


def test_auto_defers_the_logits_only_outside_fp32() -> None:
    assert not _model_loss("auto", torch.float32)[2]
    assert _model_loss("auto", torch.bfloat16)[2]


def _peak(fused: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> int:
    gen = torch.Generator().manual_seed(0)
    n, v = 512, 4096
    monkeypatch.setitem(linear_ce.CHUNK_ELEMENTS, "cpu", 64 * v)  # chunks of 64 rows
    with LiveTensorMemory() as mem:
        x = torch.randn(n, 64, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(v, 64, generator=gen).to(dtype).requires_grad_()
        t = torch.randint(0, v, (n,), generator=gen)
        mem.reset_peak()
        base = mem.current
        out = HeadOutput(x, w) if fused else F.linear(x, w)
        lm_loss(out, t, torch.ones(n)).backward()
    return mem.peak - base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_head_never_holds_the_logits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = 512 * 4096 * dtype.itemsize
    unfused, fused = _peak(False, dtype, monkeypatch), _peak(True, dtype, monkeypatch)
    assert unfused >= 2 * logits  # the logits and their gradient
    # one chunk's logits in fp32 and bf16 and their gradient (< 3 MiB), the fp32 dW and its cast
    # (1.5 MiB), dx: nothing of the full logits' size (8 MiB fp32, 4 MiB bf16)
    chunk = 64 * 4096
    assert fused <= chunk * (4 + 4 + 2 * dtype.itemsize) + 512 * 64 * 4 + 4096 * 64 * 6, (fused, unfused)
    assert fused < unfused / 2


def test_planner_prices_the_chunked_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """``head_bytes`` with chunks (saved + backward transient, the input aside) within 5% of the peak of
    live tensor bytes of one forward + backward in bf16."""
    from megapost.plan.memory import head_bytes

    measured = _peak(True, torch.bfloat16, monkeypatch)
    cfg = ModelConfig(vocab_size=4096, num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=512)
    saved, transient = head_bytes(cfg, 1, 1, False, 2, chunk_elements=64 * 4096)
    planned = saved - 2 * 512 * 64 + transient
    assert abs(measured / planned - 1) <= 0.05, (measured, planned)


def test_fused_paths_still_call_every_module_with_parameters() -> None:
    """The distributed optimizer waits for a module's parameter gather in a forward pre-hook: the fused
    add + norm and the deferred head must still call the norm and head modules."""
    cfg = ModelConfig(vocab_size=96, num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      seq_length=16)
    model = LlamaModel(cfg).to(torch.bfloat16)
    model.head.returns_head_output = True
    set_kernel_fusion(model, parse_fusion("norm,ce"))
    called: set[str] = set()
    for name, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(lambda _m, _a, name=name: called.add(name))
    out = model(torch.randint(0, 96, (2, 16)))
    assert isinstance(out, HeadOutput)
    want = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert "head.lm_head" in want and "layers.0.attention_norm" in want and called == want


def test_only_the_loss_path_gets_a_head_output() -> None:
    """A plugin calling the built model (collapse_metrics' autopsy) gets logits; the step runner's
    passes, inside ``head_output()``, leave them to the loss."""
    from megapost.parallel import build_model
    from megapost.parallel.state import ParallelState

    cfg = ModelConfig(vocab_size=96, num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      seq_length=16)
    model, loss_fn = build_model(cfg, ParallelState())
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 96, (2, 16))
    assert model(tokens).shape == (2, 16, 96)
    with model.head_output():
        out = model(tokens)
    assert isinstance(out, HeadOutput) and isinstance(model(tokens), torch.Tensor)
    assert torch.isfinite(loss_fn(out, tokens, torch.ones(2, 16)))
