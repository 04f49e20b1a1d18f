"""The Triton kernels' start-up check: each chosen kernel launched once on a small tensor of the run's
widths and dtype, forward and backward, and compared with its torch path (``megapost.kernels.add_norm``,
``rope``, ``swiglu``). A kernel that fails to compile or launch (Triton builds a C launcher at the first
CUDA launch: a node without a C compiler or Python headers cannot), or whose result differs, takes its
fusion off Triton (``Fusion.triton_off``: that op's torch path, as ``--no-triton-kernels`` does for all)
instead of taking the run down at its first norm; ``triton_note`` names the kernel and the error.

Runs where the kernels run (``triton_common.runs_on``: CUDA, or CPU tensors under Triton's interpreter,
which is how the tests inject a failure into a kernel's first launch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from megapost.kernels.add_norm import add_rms_norm
from megapost.kernels.rope import rope
from megapost.kernels.swiglu import swiglu_packed
from megapost.kernels.triton_norm import triton_add_rms_norm
from megapost.kernels.triton_rope import triton_rope, triton_rope_qkv
from megapost.kernels.triton_swiglu import triton_swiglu

# max |triton - torch| / max |torch| allowed: the kernels round as torch does, but sum in another order
# and a GPU may contract a multiply and an add (fp32 measured <= 1.7e-7; bf16 within one ulp, 2^-7)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
ROWS = 8  # tokens of the small tensors (2 sequences of 4)


class Widths(NamedTuple):
    """A rank's widths: hidden, query heads, key/value groups, head dim, FFN."""

    hidden: int
    nq: int
    nk: int
    dim: int
    ffn: int


class Mismatch(RuntimeError):
    """A kernel ran but its result differs from its torch path's."""


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        if not rel <= tol:  # NaN too
            raise Mismatch(f"max |diff| / max |torch| {rel:.3g} > {tol:.3g}")


Outputs = Callable[..., tuple[torch.Tensor, ...]]


def _stages(fused: Outputs, reference: Outputs, inputs: list[torch.Tensor], labels: tuple[str, str],
            tol: float) -> None:
    """``fused`` and ``reference`` forward on the same inputs (compared: ``labels[0]``'s kernel), then
    backward with the same output gradients (the inputs' gradients compared: ``labels[1]``'s). Raises
    ``RuntimeError("<label>: <error>")``."""
    gen = torch.Generator().manual_seed(1)
    xs_f, xs_r = ([t.detach().clone().requires_grad_() for t in inputs] for _ in range(2))
    out_r = reference(*xs_r)
    label = labels[0]
    try:
        out_f = fused(*xs_f)
        _compare(list(out_f), list(out_r), tol)
        label = labels[1]
        gos = [torch.randn(o.shape, generator=gen).to(o) for o in out_r]
        got = torch.autograd.grad(out_f, xs_f, gos)
        _compare(list(got), list(torch.autograd.grad(out_r, xs_r, gos)), tol)
    except Exception as err:  # noqa: BLE001 - any failure of a kernel is its fusion's fallback
        raise RuntimeError(f"{label}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") \
            from err


def _norm(t: Callable[..., torch.Tensor], w: Widths, tol: float) -> None:
    x, h, g = t(ROWS, w.hidden), t(ROWS, w.hidden), 1 + 0.1 * t(w.hidden)
    _stages(lambda a, b, g: triton_add_rms_norm(a, b, g, 1e-5), lambda a, b, g: add_rms_norm(a, b, g, 1e-5),
            [x, h, g], ("add_rms_norm", "add_rms_norm_backward"), tol)


def _rope(t: Callable[..., torch.Tensor], w: Widths, tol: float) -> None:
    nq, nk, dim = w.nq, w.nk, w.dim
    cos, ssin = t(4, 1, dim), t(4, 1, dim)
    _stages(lambda x: (triton_rope(x, cos, ssin),), lambda x: (rope(x, cos, ssin),), [t(2, 4, nq, dim)],
            ("rope", "rope (backward)"), tol)

    def split(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = qkv.split((nq, nk, nk), dim=2)
        return rope(q, cos, ssin), rope(k, cos, ssin), v

    _stages(lambda qkv: triton_rope_qkv(qkv, nq, nk, cos, ssin), split, [t(2, 4, nq + 2 * nk, dim)],
            ("rope", "rope_qkv_backward"), tol)


def _swiglu(t: Callable[..., torch.Tensor], w: Widths, tol: float) -> None:
    _stages(lambda h: (triton_swiglu(h),), lambda h: (swiglu_packed(h),), [t(ROWS, 2 * w.ffn)],
            ("swiglu", "swiglu_backward"), tol)


CHECKS = {"norm": _norm, "rope": _rope, "swiglu": _swiglu}


def self_check(device: torch.device, names: list[str], dtype: torch.dtype, widths: Widths) -> dict[str, str]:
    """The fusions of ``names`` (of "norm", "rope", "swiglu") whose Triton kernels fail on ``device`` at
    activations of ``dtype`` and the run's widths (per rank), each with "<kernel>: <error>"; {} when all
    pass."""
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    failed = {}
    for name in names:
        try:
            CHECKS[name](tensor, widths, TOL.get(dtype, 1e-4))
        except RuntimeError as err:
            failed[name] = str(err)
    return failed
