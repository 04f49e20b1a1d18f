"""Rotary position embedding as one Triton kernel each way (``megapost::rope``, one torch op to dispatch
per direction), where ``megapost.kernels.rope`` dispatches 3 ops forward and 4 backward: the same
products and roundings in fp32 registers (forward x cos rounded, then one multiply-add; backward both
products rounded, then their sum), the rotate-half swap by index. Not bit-identical on a GPU (it may
contract a multiply and an add), so under ``--kernel-fusion`` auto not in fp32. Runs where
``triton_common.runs_on`` (CUDA with Triton); kernel body: ``triton_kernels.rope_rows``."""

from __future__ import annotations

from typing import Any

import torch

from megapost.kernels.triton_common import cdiv, jitted, runs_on, torch_op


def rope_path(device: torch.device) -> str:
    """Which fused RoPE runs on ``device`` (the one place it is chosen): "triton" where the Triton
    kernels run (``runs_on``), else "function" (``megapost.kernels.rope``, torch ops)."""
    return "triton" if runs_on(device) else "function"


@torch_op("rope(Tensor x, Tensor cos, Tensor signed_sin, bool backward) -> Tensor")
def _rope_op(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, S, H, D] (any strides, the last 1) rotated by the tables [S, D] (transposed rotation when
    ``backward``); contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    bsz, seq, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = bsz * seq * heads
    block_d = 1 << max(0, (dim // 2 - 1).bit_length())
    block_r = max(1, min(32, 2048 // block_d))
    jitted("rope_rows")[(cdiv(rows, block_r),)](
        x, cos, signed_sin, y, rows, seq, heads, x.stride(0), x.stride(1), x.stride(2), dim // 2,
        BACKWARD=backward, BLOCK_R=block_r, BLOCK_D=block_d)
    return y


@_rope_op.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, backward: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _TritonRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.ops.megapost.rope(x, cos, signed_sin, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.ops.megapost.rope(grad, cos, signed_sin, True), None, None


def triton_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``megapost.kernels.rope``'s contract in Triton: ``x`` [b, s, heads, d] with tables [s, 1, d], or
    [b, heads, s, d] with tables [s, d] (rotated as its [b, s, heads, d] transpose); the tables take
    no gradient."""
    heads_first = cos.dim() == 2
    rows = x.transpose(1, 2) if heads_first else x
    dim = x.shape[-1]
    tables = [t.reshape(-1, dim).contiguous() for t in (cos, signed_sin)]
    y = _TritonRope.apply(rows, *tables)
    return y.transpose(1, 2) if heads_first else y


@torch_op("rope_qkv_backward(Tensor dq, Tensor dk, Tensor dv, Tensor cos, Tensor signed_sin) -> Tensor")
def _rope_qkv_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                          signed_sin: torch.Tensor) -> torch.Tensor:
    """The packed [B, S, heads + 2 groups, D] gradient of ``triton_rope_qkv``'s input from its outputs'
    gradients (any strides, the last 1): q's and k's rotated back, v's copied; contiguous."""
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    bsz, seq, nq, dim = dq.shape
    nk = dk.shape[2]
    y = torch.empty((bsz, seq, nq + 2 * nk, dim), dtype=dq.dtype, device=dq.device)
    rows = bsz * seq * (nq + 2 * nk)
    block_d = 1 << max(0, (dim // 2 - 1).bit_length())
    block_r = max(1, min(32, 2048 // block_d))
    strides = [st for t in (dq, dk, dv) for st in t.stride()[:3]]
    jitted("rope_qkv_bwd")[(cdiv(rows, block_r),)](
        dq, dk, dv, cos, signed_sin, y, rows, seq, nq, nk, *strides, dim // 2, BLOCK_R=block_r,
        BLOCK_D=block_d)
    return y


@_rope_qkv_backward_op.register_fake
def _(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
      signed_sin: torch.Tensor) -> torch.Tensor:
    bsz, seq, nq, dim = dq.shape
    return dq.new_empty((bsz, seq, nq + 2 * dk.shape[2], dim))


class _TritonRopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, nq: int, nk: int, cos: torch.Tensor,
                signed_sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(cos, signed_sin)
        qk = torch.ops.megapost.rope(qkv.narrow(2, 0, nq + nk), cos, signed_sin, False)
        q, k = qk.split((nq, nk), dim=2)
        return q, k, qkv.narrow(2, nq + nk, nk)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, signed_sin = ctx.saved_tensors
        return torch.ops.megapost.rope_qkv_backward(dq, dk, dv, cos, signed_sin), None, None, None, None


def triton_rope_qkv(qkv: torch.Tensor, nq: int, nk: int, cos: torch.Tensor,
                    signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [b, s, heads, d] from the packed [b, s, nq + 2 nk, d] Q/K/V GEMM output, q and k
    rotated (tables [s, 1, d]) by one ``megapost::rope``, v a view; backward one
    ``megapost::rope_qkv_backward`` writing the packed gradient (where split, rope and split dispatch
    two ``cat``s and a rope). Bit-identical to ``triton_rope`` on the packed q, k."""
    tables = [t.reshape(-1, qkv.shape[-1]).contiguous() for t in (cos, signed_sin)]
    return _TritonRopeQKV.apply(qkv, nq, nk, *tables)

