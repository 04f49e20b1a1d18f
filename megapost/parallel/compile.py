"""Regional ``torch.compile``: each transformer block compiled on its own, never the whole model.

A compiled block runs only when no probe under it has a listener; a step whose probes listen (a
collapse_metrics measured step) runs the block's eager forward, so its Python hooks and measurements
are exactly the eager ones. A checkpointed recompute sees the probes as its forward did (silent
listeners, see ``activation_checkpoint``), so it reruns the same eager or compiled forward.
Tensor/sequence-parallel collectives are excluded from the compiled graphs
(``megapost.parallel.mappings`` wraps them with ``torch.compiler.disable``): each is a clean graph
break. All blocks share one compiled code object (same ``forward`` code; parameters are graph inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megapost.model import TransformerBlock
from megapost.model.probe import Probe


def _listening(probes: list[Probe]) -> bool:
    return any(p.listener is not None for p in probes)


def _dispatch(eager: Callable[..., Any], compiled: Callable[..., Any],
              probes: list[Probe]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return (eager if _listening(probes) else compiled)(*args, **kwargs)

    return forward


def compile_blocks(model: nn.Module) -> int:
    """Compile every ``TransformerBlock`` under ``model`` in place (``dynamic=False``); returns how many.
    Works on a ``ParallelLlamaModel`` and on a DeepSpeed ``PipelineModule`` stage alike."""
    count = 0
    for block in model.modules():
        if not isinstance(block, TransformerBlock) or "forward" in vars(block):
            continue
        eager = block.forward
        probes = [m for m in block.modules() if isinstance(m, Probe)]
        block.forward = _dispatch(eager, torch.compile(eager, dynamic=False), probes)
        count += 1
    return count
