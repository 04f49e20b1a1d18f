"""Zero-cost observation points at sublayer boundaries (the model's only concession to metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Listener = Callable[..., None]


class Probe(nn.Module):
    """Calls ``listener(name=..., **tensors)`` when one is attached; otherwise does nothing.

    ``name`` identifies the boundary, e.g. ``("layer", 3, "attn")``, ``("embed",)``, ``("head",)``.
    """

    def __init__(self, name: tuple[Any, ...]) -> None:
        super().__init__()
        self.name = name
        self.listener: Listener | None = None

    def forward(self, **tensors: torch.Tensor | None) -> None:  # type: ignore[override]
        if self.listener is not None:
            self.listener(self.name, **tensors)


def set_listener(module: nn.Module, listener: Listener | None) -> int:
    """Attach (or detach with None) ``listener`` to every probe under ``module``; returns the count."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, Probe):
            sub.listener = listener
            count += 1
    return count
