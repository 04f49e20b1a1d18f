"""Language-model loss: mean token cross-entropy over the loss mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(CE * mask) / sum(mask), CE in fp32."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    mask = loss_mask.flatten().float()
    return (ce * mask).sum() / mask.sum()
