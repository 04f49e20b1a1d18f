"""The LM head's GEMM and the cross-entropy in one autograd Function, chunked over tokens, so the logits
[tokens, vocab] never exist in full, neither in the activations' dtype nor in fp32 (Liger's / torchtitan's
chunked loss). Per chunk of rows: forward z = x W^T, log Z = logsumexp(z) and z_t in fp32 (fp64 for
fp64 input); backward recomputes z (one more head GEMM per chunk), dz = softmax(z) (g + g_lse) - onehot(t) g
in fp32, cast to the activations' dtype, dx = dz W (the chunk's rows) and dW += dz^T x, accumulated
in fp32. Saved: the input, the weight (both already held), the targets and fp32 log Z per token.

The same ops per row as the unfused head + ``megapost.model.loss``, but not bit-identical: a GEMM of
fewer rows may round differently, and dW sums over chunks (fp32 rel 1e-6; bf16: each chunk's product
rounded to bf16 before the fp32 sum; tested against torch's fp64 cross-entropy)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# fp32 elements of one chunk of logit rows: on CPU 16 MiB, elsewhere 256 MiB (a few chunks at the
# paper's 8192 x 32000 head; fewer launches than smaller chunks)
CHUNK_ELEMENTS = {"cpu": 1 << 22}
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Token rows per chunk for a head of ``vocab`` outputs on ``device``."""
    return max(1, CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS) // max(vocab, 1))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        picked = torch.empty(n, dtype=dtype, device=hidden.device)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            z = F.linear(hidden[start:stop], weight).to(dtype)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            picked[start:stop] = z.gather(-1, target[start:stop].unsqueeze(-1)).squeeze(-1)
            del z  # before the next chunk's GEMM: one chunk alive at a time
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.rows = rows
        ctx.set_materialize_grads(False)
        return lse - picked, lse.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None,
                 grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, target, lse = ctx.saved_tensors
        n, rows = hidden.shape[0], ctx.rows
        dx = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = (torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
              if ctx.needs_input_grad[1] else None)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            x = hidden[start:stop]
            p = F.linear(x, weight).to(lse.dtype).sub_(lse[start:stop].unsqueeze(-1)).exp_()
            g = grad[start:stop].unsqueeze(-1) if grad is not None else None
            g_lse = grad_lse[start:stop].unsqueeze(-1) if grad_lse is not None else None
            p.mul_(g_lse if g is None else g if g_lse is None else g + g_lse)
            if g is not None:
                p.scatter_add_(-1, target[start:stop].unsqueeze(-1), -g)
            dz = p.to(hidden.dtype)
            if dx is not None:
                torch.mm(dz, weight, out=dx[start:stop])
            if dw is not None:
                dw.add_(dz.t().mm(x))
            del p, dz
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE_i, log Z_i) in fp32 per row of ``hidden`` [n, h] for logits ``hidden @ weight.T`` ([v, h],
    no bias) and targets [n] in [0, v), without the [n, v] logits (module docstring); ``rows`` per
    chunk (default ``chunk_rows``)."""
    rows = rows or chunk_rows(weight.shape[0], hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, target, rows)
