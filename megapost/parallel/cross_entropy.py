"""Cross-entropy over vocabulary-sharded logits, without gathering the full vocabulary anywhere.

Per token, with this rank holding logits z[v0:v1]: m = max_v z (all-reduce MAX), then
S = sum_v exp(z_v - m) and z_t - m for the target t (owned by one rank, zero elsewhere) are summed over
TP in one all-reduce of a stacked [2, tokens] tensor; CE = log S - (z_t - m). The backward is local:
dCE/dz_v = softmax_v - [v == t] on the rows this rank holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megapost.model.loss import lm_loss

from . import collectives as C
from .layers import tp_rank_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
        z = logits.float()
        rank, _ = tp_rank_size(group)
        width = z.shape[-1]
        z = z - C.all_reduce(z.max(dim=-1).values, group, op=dist.ReduceOp.MAX).unsqueeze(-1)
        local_t = target - rank * width
        owned = (local_t >= 0) & (local_t < width)
        local_t = local_t.masked_fill(~owned, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = z.exp()
        sum_exp, target_logit = C.all_reduce(torch.stack((exp.sum(dim=-1), target_logit)), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, owned)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_t, owned = ctx.saved_tensors
        grad_z = softmax.scatter_add(-1, local_t.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype))
        return (grad_z * grad.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """Per-token CE in fp32 (shape of ``target``) from logits sharded on the last dim over ``group``."""
    return _VocabParallelCE.apply(logits, target, group)


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                           group: Any) -> torch.Tensor:
    """``megapost.model.lm_loss`` (sum(CE * mask) / sum(mask)) on vocab-sharded logits; the result is
    identical on every tensor-parallel rank. Falls back to ``lm_loss`` without a TP group."""
    if group is None or C.group_size(group) == 1:
        return lm_loss(logits, labels, loss_mask)
    ce = vocab_parallel_cross_entropy(logits, labels, group)
    mask = loss_mask.flatten().float()
    return (ce.flatten() * mask).sum() / mask.sum()
