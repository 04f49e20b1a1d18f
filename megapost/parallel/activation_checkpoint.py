"""Activation checkpointing that does not report activations to probe listeners twice.

Recomputation re-runs block forwards, and with them the blocks' ``Probe`` modules. The non-reentrant
``torch.utils.checkpoint`` takes a ``context_fn`` giving one context for the original forward and one
for the recompute; the recompute context gives every probe under ``root`` that listened during the
original forward a silent listener (and the others none), restoring the listeners afterwards. So a
listener sees each activation exactly once (from the original forward, whose tensors are part of the
backward graph, so gradient hooks a listener registers on them still fire), and the recompute sees
the probes as the forward did (``--compile`` then picks the same eager or compiled block forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megapost.model.probe import Probe


def silent_listener(*_args: Any, **_tensors: Any) -> None:
    """A listener that ignores what it is shown."""


@contextmanager
def probes_silenced(probes: Sequence[Probe], listened: Sequence[bool]) -> Iterator[None]:
    """For the duration of the block, ``probes[i]`` has a silent listener if ``listened[i]``, else none."""
    listeners = [p.listener for p in probes]
    for p, heard in zip(probes, listened, strict=True):
        p.listener = silent_listener if heard else None
    try:
        yield
    finally:
        for p, listener in zip(probes, listeners, strict=True):
            p.listener = listener


def probes_under(*modules: nn.Module) -> list[Probe]:
    """Every ``Probe`` under ``modules``, in module order (walk once, then reuse the list)."""
    return [m for module in modules for m in module.modules() if isinstance(m, Probe)]


def checkpoint_with_probes(probes: Sequence[Probe], function: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``function(*args)`` with activations recomputed in backward, ``probes`` (those ``function`` runs:
    ``probes_under`` its modules) silent then (a plain call when gradients are off, e.g. evaluation)."""
    if not torch.is_grad_enabled():
        return function(*args)
    listened = [p.listener is not None for p in probes]  # now, at the original forward
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), probes_silenced(probes, listened)))


def checkpoint_without_probes(root: nn.Module, function: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``checkpoint_with_probes`` over every probe under ``root`` (walks ``root`` on each call: pass
    the segment's own probes to ``checkpoint_with_probes`` where the segment is known)."""
    return checkpoint_with_probes(probes_under(root), function, *args)
