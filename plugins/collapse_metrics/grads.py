"""Per-layer parameter-gradient squared norms before the optimizer step, exact under any layout.

Layers are found by walking modules for transformer blocks (a ``layer_number`` and probes), so the
same code serves the plain model, the tensor-parallel one and a DeepSpeed ``PipelineModule`` stage
(whose own layer indices are offset). Inside a block, parameters are grouped by name (``group_of``):
every norm's parameters -> norms (the residual-stream norms ``attention_norm`` / ``mlp_norm``, the
sandwich output norms ``*_out_norm``, the head norms ``attention.{q,k,v}_norm``; RMSNorm gains and DyT's
``alpha`` and ``weight`` alike), the other ``attention.*`` -> attn, ``mlp.*`` -> ffn; every one counts in
the layer total. Parameters outside the blocks (embedding, ``embedding.scale`` of DyT, head) belong to
no layer and are not measured here.

Each rank adds only the part of ||grad||^2 it owns, so one sum over all ranks gives the full value:
  * tensor parallelism: shards tagged ``tensor_model_parallel`` count on every TP rank, replicated
    parameters (the RMSNorm gains) only on TP rank 0;
  * ZeRO 1/2 and DeepSpeed's bf16 optimizer keep the reduced fp32 gradient as flat partitions: a rank
    counts the fragment of each parameter it owns (the slice ``safe_get_full_grad`` would contribute
    to its all-reduce), ZeRO-3 its local partition (``safe_get_local_grad``);
  * a full, data-parallel-reduced ``param.grad`` (no ZeRO partitioning) counts on DP rank 0 only.
No collective is issued here; the squared norms join the step's single reduction.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .similarity import norm
from .table import GCOL

SUBLAYER_GROUP = {"attention": "attn", "mlp": "ffn"}


def group_of(name: str) -> str:
    """Group of a block parameter by its name relative to the block: "norms" when the module owning it is a
    norm (its name ends in ``norm``), else "attn" / "ffn" by the first component; "other" otherwise."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-2].endswith("norm"):
        return "norms"
    return SUBLAYER_GROUP.get(parts[0], "other")


def transformer_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """Modules that are transformer blocks: an int ``layer_number`` and a ``probe_attn``."""
    for m in module.modules():
        if isinstance(getattr(m, "layer_number", None), int) and hasattr(m, "probe_attn"):
            yield m


class LayerParameters:
    """The trainable parameters of the selected layers (``rows``: layer number -> table row) and the
    table indices their squared gradient norms go to, cached on the table's device."""

    def __init__(self, module: nn.Module, rows: dict[int, int]) -> None:
        self.params: list[nn.Parameter] = []
        self.rows: list[int] = []
        self.groups: list[str] = []
        for block in transformer_blocks(module):
            row = rows.get(block.layer_number)
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
    def add_squared_norms(self, table: torch.Tensor, tp_rank: int, dp_rank: int, scale: float = 1.0) -> None:
        """table[row, group] and table[row, total] += ||owned grad||^2 / scale^2; table[:, count] += 1."""
        if not self.params:
            return
        zero = torch.zeros((), dtype=torch.float64, device=table.device)
        norms = []
        for param in self.params:
            grad = owned_grad(param, tp_rank, dp_rank)
            norms.append(zero if grad is None else norm(grad).double().to(table.device))
        sq = torch.stack(norms).square() / (scale * scale)
        rows, total, named, cols = self.index(table.device)
        table.index_put_((rows, total), sq, accumulate=True)
        table.index_put_((rows[named], cols), sq[named], accumulate=True)
        table[:, GCOL["count"]] += 1.0


def owned_grad(param: nn.Parameter, tp_rank: int, dp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s reduced gradient whose squared norm this rank contributes (or None)."""
    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
        return None
    if getattr(param, "_hp_grad", None) is not None:  # DeepSpeed BF16_Optimizer
        return _hp_fragment(param)
    if param.grad is not None:
        return param.grad if dp_rank == 0 else None
    if hasattr(param, "ds_id"):  # ZeRO-3
        from deepspeed.utils import safe_get_local_grad

        return safe_get_local_grad(param)
    if hasattr(param, "_hp_mapping"):  # ZeRO 1/2
        return _hp_fragment(param)
    return None


def _hp_fragment(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's slice of the flat-partitioned gradient (as in DeepSpeed's ``get_full_hp_grad``)."""
    mapping = param._hp_mapping
    if mapping is None:  # this rank's partition holds no element of param
        return None
    grad = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
    address = mapping.lp_fragment_address
    if grad.numel() == param.numel():  # a full accumulation buffer: keep the owned slice
        grad = grad.narrow(0, address.start, address.numel)
    return grad


def loss_scale(engine: Any) -> float:
    """The fp16 dynamic loss scale the gradients still carry before the step (1 otherwise)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if callable(fp16) and fp16():
        return float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)
    return 1.0
