"""Language-model loss: mean token cross-entropy over the loss mask, in fp32 from logits of any dtype."""

from __future__ import annotations

from typing import Any

import torch

# fp32 elements of one block of logit rows: on CPU a block stays in L2 cache (2 MiB); elsewhere the
# blocks only bound the fp32 temporaries.
BLOCK_ELEMENTS = {"cpu": 1 << 19}
DEFAULT_BLOCK_ELEMENTS = 1 << 27


def _blocks(rows: int, vocab: int, device: torch.device) -> range:
    step = max(1, BLOCK_ELEMENTS.get(device.type, DEFAULT_BLOCK_ELEMENTS) // max(vocab, 1))
    return range(0, rows, step)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 logits (never narrower than the input)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _CrossEntropy(torch.autograd.Function):
    """CE_i = logsumexp(z_i) - z_i[t_i] per row of ``logits`` [n, v], computed in fp32 (fp64 for
    fp64 logits) one block of
    rows at a time; backward recomputes softmax from the saved logits: dCE_i/dz_i = softmax(z_i) -
    onehot(t_i). No full-size fp32 copy of the logits or of the log-probabilities is ever made."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        dtype = _compute_dtype(logits)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        picked = torch.empty(n, dtype=dtype, device=logits.device)
        blocks = _blocks(n, v, logits.device)
        for start in blocks:
            stop = min(start + blocks.step, n)
            z = logits[start:stop].to(dtype)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            picked[start:stop] = z.gather(-1, target[start:stop].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, target, lse)
        return lse - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        out = torch.empty_like(logits)
        blocks = _blocks(n, v, logits.device)
        for start in blocks:
            stop = min(start + blocks.step, n)
            p = logits[start:stop].to(lse.dtype).sub_(lse[start:stop].unsqueeze(-1)).exp_()
            t = target[start:stop].unsqueeze(-1)
            p.scatter_add_(-1, t, torch.full(t.shape, -1.0, dtype=p.dtype, device=p.device))
            out[start:stop] = p.mul_(grad[start:stop].unsqueeze(-1))
        return out, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token CE in fp32, shape of ``target``; ``logits`` [..., v], every target in [0, v)."""
    ce = _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return ce.view(target.shape)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(CE * mask) / sum(mask), CE in fp32."""
    ce = cross_entropy(logits, labels).flatten()
    mask = loss_mask.flatten().float()
    return (ce * mask).sum() / mask.sum()
