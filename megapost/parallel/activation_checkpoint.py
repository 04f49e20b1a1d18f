"""Activation checkpointing that does not report activations to probe listeners twice.

Recomputation re-runs block forwards, and with them the blocks' ``Probe`` modules. The non-reentrant
``torch.utils.checkpoint`` takes a ``context_fn`` giving one context for the original forward and one
for the recompute; the recompute context silences every probe listener under ``root`` and restores it
afterwards, so a listener sees each activation exactly once (from the original forward, whose tensors
are part of the backward graph, so gradient hooks a listener registers on them still fire).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megapost.model.probe import Probe


def _silent(*_args: Any, **_tensors: Any) -> None:
    """A listener that ignores what it is shown."""


@contextmanager
def probes_silenced(root: nn.Module) -> Iterator[None]:
    """Replace the listeners of all probes under ``root`` by a silent one for the duration of the block
    (kept attached, so ``--compile`` recomputes a measured step eagerly, as its forward ran)."""
    probes = [m for m in root.modules() if isinstance(m, Probe) and m.listener is not None]
    listeners = [p.listener for p in probes]
    for p in probes:
        p.listener = _silent
    try:
        yield
    finally:
        for p, listener in zip(probes, listeners, strict=True):
            p.listener = listener


def checkpoint_without_probes(root: nn.Module, function: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``function(*args)`` with activations recomputed in backward, probes under ``root`` silent then
    (a plain call when gradients are off, e.g. evaluation)."""
    if not torch.is_grad_enabled():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), probes_silenced(root)))
