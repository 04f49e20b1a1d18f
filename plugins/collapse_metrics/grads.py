"""Per-layer parameter-gradient squared norms before the optimizer step, exact under any layout.

Layers are found by walking modules for transformer blocks (a ``layer_number`` and probes), so the
same code serves the plain model, the tensor-parallel one and a DeepSpeed ``PipelineModule`` stage
(whose own layer indices are offset). Inside a block, parameters are grouped by name (``group_of``):
every norm's parameters -> norms (the residual-stream norms ``attention_norm`` / ``mlp_norm``, the
sandwich output norms ``*_out_norm``, the head norms ``attention.{q,k,v}_norm``; RMSNorm gains and DyT's
``alpha`` and ``weight`` alike), the other ``attention.*`` -> attn, ``mlp.*`` -> ffn; every one counts in
the layer total. Parameters outside the blocks (embedding, ``embedding.scale`` of DyT, head) belong to
no layer and are not measured here.

Each rank adds only the part of ||grad||^2 it owns (``PluginContext.owned_grad``: TP shards, ZeRO
partitions, DP rank 0 for replicated full gradients; megapost.optim.accessors says how), so one sum
over all ranks gives the full value. No collective is issued here; the squared norms join the step's
single reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .similarity import accumulation_dtype
from .table import GCOL

SUBLAYER_GROUP = {"attention": "attn", "mlp": "ffn"}


def group_of(name: str) -> str:
    """Group of a block parameter by its name relative to the block: "norms" when the module owning it is a
    norm (its name ends in ``norm``), else "attn" / "ffn" by the first component; "other" otherwise."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-2].endswith("norm"):
        return "norms"
    return SUBLAYER_GROUP.get(parts[0], "other")


class LayerParameters:
    """The trainable parameters of the selected layers (``rows``: layer number -> table row) and the
    table indices their squared gradient norms go to, cached on the table's device."""

    def __init__(self, blocks: Iterable[tuple[int, nn.Module]], rows: dict[int, int]) -> None:
        """``blocks``: (layer number, block) of the module's transformer blocks (``ModelView.blocks``)."""
        self.params: list[nn.Parameter] = []
        self.rows: list[int] = []
        self.groups: list[str] = []
        for layer_number, block in blocks:
            row = rows.get(layer_number)
            if row is None:
                continue
            for name, param in block.named_parameters():
                if param.requires_grad:
                    self.params.append(param)
                    self.rows.append(row)
                    self.groups.append(group_of(name))
        self._index: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def index(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows, total column, positions with a named group, their group columns)."""
        if device not in self._index:
            named = [i for i, g in enumerate(self.groups) if g in GCOL]
            rows = torch.tensor(self.rows, dtype=torch.long)
            self._index[device] = tuple(t.to(device, non_blocking=True) for t in (
                rows, torch.full_like(rows, GCOL["total"]), torch.tensor(named, dtype=torch.long),
                torch.tensor([GCOL[self.groups[i]] for i in named], dtype=torch.long)))
        return self._index[device]

    @torch.no_grad()
    def add_squared_norms(self, table: torch.Tensor, owned_grad: Callable[[nn.Parameter], Any],
                          scale: float = 1.0) -> None:
        """table[row, group] and table[row, total] += ||owned_grad(param)||^2 / scale^2 (the part this rank
        owns, or None); table[:, count] += 1. One ``torch._foreach_norm`` per gradient dtype and device."""
        if not self.params:
            return
        sq = torch.zeros(len(self.params), dtype=torch.float64, device=table.device)
        groups: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[torch.Tensor]]] = {}
        for i, param in enumerate(self.params):
            grad = owned_grad(param)
            if grad is not None:
                where, grads = groups.setdefault((grad.dtype, grad.device), ([], []))
                where.append(i)
                grads.append(grad)
        for where, grads in groups.values():
            norms = torch._foreach_norm(grads, 2, dtype=accumulation_dtype(grads[0]))
            index = torch.tensor(where, dtype=torch.long).to(table.device, non_blocking=True)
            sq.index_copy_(0, index, torch.stack(norms).to(table.device, torch.float64, non_blocking=True))
        sq = sq.square() / (scale * scale)
        rows, total, named, cols = self.index(table.device)
        table.index_put_((rows, total), sq, accumulate=True)
        table.index_put_((rows[named], cols), sq[named], accumulate=True)
        table[:, GCOL["count"]] += 1.0
