"""SwiGLU's gate on the packed [..., 2f] output of the W_1/W_3 GEMM as one Triton kernel each way
(``megapost::swiglu`` and ``megapost::swiglu_backward``: one op to dispatch per direction), where
``megapost.kernels.swiglu`` dispatches 2 ops forward (silu, mul) and 4 backward (silu recomputed, two
muls, silu_backward). The same ops per element in fp32 registers with the same roundings to the storage
dtype; not bit-identical on a GPU (its exp may differ from torch's in the last fp32 bit), so under
``--kernel-fusion`` auto not in fp32. Saves only its input, as the Function does. Runs where
``triton_common.runs_on`` (CUDA with Triton); kernel body: ``triton_kernels.swiglu_rows``."""

from __future__ import annotations

from typing import Any

import torch

from megapost.kernels.triton_common import cdiv, jitted, runs_on, torch_op


def swiglu_path(device: torch.device) -> str:
    """Which fused SwiGLU gate runs on ``device`` (the one place it is chosen): "triton" where the Triton
    kernels run (``runs_on``), else "function" (``megapost.kernels.swiglu``, torch ops)."""
    return "triton" if runs_on(device) else "function"


def _launch(h: torch.Tensor, g: torch.Tensor, out: torch.Tensor, backward: bool) -> None:
    """``triton_kernels.swiglu_rows`` over the rows of ``h`` [..., 2f] (contiguous)."""
    f = h.shape[-1] // 2
    rows = h.numel() // (2 * f)
    block_f = min(1024, 1 << max(0, (f - 1).bit_length()))
    block_m = max(1, min(16, 4096 // block_f))
    jitted("swiglu_rows")[(cdiv(rows, block_m), cdiv(f, block_f))](
        h, g, out, rows, f, BACKWARD=backward, BLOCK_M=block_m, BLOCK_F=block_f)


@torch_op("swiglu(Tensor h13) -> Tensor")
def _swiglu_op(h13: torch.Tensor) -> torch.Tensor:
    """silu(h13[..., :f]) * h13[..., f:], contiguous [..., f]."""
    f = h13.shape[-1] // 2
    h = h13.contiguous()
    y = torch.empty((*h.shape[:-1], f), dtype=h.dtype, device=h.device)
    _launch(h, h, y, backward=False)
    return y


@_swiglu_op.register_fake
def _(h13: torch.Tensor) -> torch.Tensor:
    return h13.new_empty((*h13.shape[:-1], h13.shape[-1] // 2))


@torch_op("swiglu_backward(Tensor h13, Tensor grad) -> Tensor")
def _swiglu_backward_op(h13: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """[dh1 | dh3], contiguous like ``h13``, for the gate's output gradient ``grad``."""
    h, g = h13.contiguous(), grad.contiguous()
    d = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    _launch(h, g, d, backward=True)
    return d


@_swiglu_backward_op.register_fake
def _(h13: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty(h13.shape, dtype=h13.dtype, device=h13.device)


class _TritonSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h13: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h13)
        return torch.ops.megapost.swiglu(h13)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (h13,) = ctx.saved_tensors
        return torch.ops.megapost.swiglu_backward(h13, grad)


def triton_swiglu(h13: torch.Tensor) -> torch.Tensor:
    """``megapost.kernels.swiglu_packed``'s contract in Triton: silu(h13[..., :f]) * h13[..., f:]."""
    return _TritonSwiGLU.apply(h13)
