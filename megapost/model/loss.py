"""Language-model loss: mean token cross-entropy over the loss mask, in fp32 from logits of any dtype,
or from the head's input and weight (``HeadOutput``: the chunked head + cross-entropy, no logits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megapost.kernels import linear_cross_entropy

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
    """(CE_i, lse_i) per row of ``logits`` [n, v]: lse_i = logsumexp(z_i), CE_i = lse_i - z_i[t_i],
    computed in fp32 (fp64 for fp64 logits) one block of rows at a time; backward recomputes softmax
    from the saved logits: dCE_i/dz_i = softmax(z_i) - onehot(t_i), dlse_i/dz_i = softmax(z_i). No
    full-size fp32 copy of the logits or of the log-probabilities is ever made."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        return lse - picked, lse.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        out = torch.empty_like(logits)
        blocks = _blocks(n, v, logits.device)
        for start in blocks:
            stop = min(start + blocks.step, n)
            p = logits[start:stop].to(lse.dtype).sub_(lse[start:stop].unsqueeze(-1)).exp_()
            t = target[start:stop].unsqueeze(-1)
            g = grad[start:stop].unsqueeze(-1)
            p.mul_(g + grad_lse[start:stop].unsqueeze(-1))
            out[start:stop] = p.scatter_add_(-1, t, -g)
        return out, None


@dataclass(frozen=True)
class HeadOutput:
    """What the head returns instead of logits under ``--kernel-fusion`` ce (``Head.forward``): its
    input [..., h] and its weight [v, h]; the loss computes the logits chunk by chunk."""

    hidden: torch.Tensor
    weight: torch.Tensor


def cross_entropy_and_lse(logits: torch.Tensor | HeadOutput,
                          target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE and log Z = logsumexp(logits) in fp32, each of the shape of ``target``;
    ``logits`` [..., v] (or a ``HeadOutput``), every target in [0, v)."""
    if isinstance(logits, HeadOutput):
        hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
        ce, lse = linear_cross_entropy(hidden, logits.weight, target.reshape(-1))
        return ce.view(target.shape), lse.view(target.shape)
    ce, lse = _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return ce.view(target.shape), lse.view(target.shape)


def cross_entropy(logits: torch.Tensor | HeadOutput, target: torch.Tensor) -> torch.Tensor:
    """Per-token CE in fp32, shape of ``target``; ``logits`` [..., v], every target in [0, v)."""
    return cross_entropy_and_lse(logits, target)[0]


def masked_lm_loss(ce: torch.Tensor, lse: torch.Tensor, loss_mask: torch.Tensor, z_loss: float = 0.0,
                   record: list[torch.Tensor] | None = None) -> torch.Tensor:
    """sum(CE * mask) / sum(mask), plus PaLM's z-loss ``z_loss`` * mean(log^2 Z) in the gradient only:
    the returned value stays the cross-entropy (comparable across runs with and without it), its
    gradient is that of CE + z_loss * log^2 Z. The z term's value (detached) is appended to ``record``."""
    mask = loss_mask.flatten().float()
    loss = (ce.flatten() * mask).sum() / mask.sum()
    if z_loss:
        z = z_loss * (lse.flatten().square() * mask).sum() / mask.sum()
        loss = loss + (z - z.detach())
        if record is not None:
            record.append(z.detach())
    return loss


def lm_loss(logits: torch.Tensor | HeadOutput, labels: torch.Tensor, loss_mask: torch.Tensor,
            z_loss: float = 0.0, record: list[torch.Tensor] | None = None) -> torch.Tensor:
    """sum(CE * mask) / sum(mask), CE in fp32 (``z_loss``, ``record``: see ``masked_lm_loss``)."""
    return masked_lm_loss(*cross_entropy_and_lse(logits, labels), loss_mask, z_loss, record)
