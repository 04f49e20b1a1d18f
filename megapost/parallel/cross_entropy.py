"""Cross-entropy over vocabulary-sharded logits, without gathering the full vocabulary anywhere.

Per token, with this rank holding logits z[v0:v1]: m = max_v z (all-reduce MAX), then
S = sum_v exp(z_v - m) and z_t - m for the target t (owned by one rank, zero elsewhere) are summed over
TP in one all-reduce of a stacked [2, tokens] tensor; CE = log S - (z_t - m). The backward is local:
dCE/dz_v = softmax_v - [v == t] on the rows this rank holds. log Z = log S + m comes along for the
z-loss (its gradient softmax_v is local too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megapost.model.loss import lm_loss, masked_lm_loss
from megapost.parallel import collectives as C
from megapost.parallel.layers import tp_rank_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor,
                group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.float()
        rank, _ = tp_rank_size(group)
        width = z.shape[-1]
        m = C.all_reduce(z.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)
        local_t = target - rank * width
        owned = (local_t >= 0) & (local_t < width)
        local_t = local_t.masked_fill(~owned, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = z.exp()
        sum_exp, target_logit = C.all_reduce(torch.stack((exp.sum(dim=-1), target_logit)), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, owned)
        ctx.logits_dtype = logits.dtype
        log_s = sum_exp.log()
        return log_s - target_logit, log_s + m

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_t, owned = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        grad_z = (softmax * (g + grad_lse.unsqueeze(-1))).scatter_add_(
            -1, local_t.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype) * g)
        return grad_z.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """Per-token CE in fp32 (shape of ``target``) from logits sharded on the last dim over ``group``."""
    return _VocabParallelCE.apply(logits, target, group)[0]


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                           group: Any, z_loss: float = 0.0,
                           record: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``megapost.model.lm_loss`` (sum(CE * mask) / sum(mask), optional z-loss) on vocab-sharded
    logits; the result is identical on every tensor-parallel rank. ``lm_loss`` without a TP group."""
    if group is None or C.group_size(group) == 1:
        return lm_loss(logits, labels, loss_mask, z_loss, record)
    return masked_lm_loss(*_VocabParallelCE.apply(logits, labels, group), loss_mask, z_loss, record)
