"""Pipeline stages of megapost's model for ``torch.distributed.pipelining``: the path of the interleaved
schedule (virtual stages, Megatron's ``--num-layers-per-virtual-pipeline-stage``) in the native engine.

A model of L layers on ``pp`` ranks with ``virtual`` chunks per rank is cut into ``pp * virtual`` chunks
of L / (pp * virtual) consecutive layers; chunk k lives on pipeline rank k % pp (Megatron's order: rank r
holds chunks r, r + pp, r + 2 pp, ...), the embedding in chunk 0, the head in the last chunk. ``virtual``
1 is plain 1F1B. Not yet the trainer's (docs/multi-gpu.md): tests/test_native_pipeline.py runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B


class Chunk(nn.Module):
    """Layers ``[start, stop)`` of ``model`` (its ``embedding``, ``layers`` and ``head``), with the
    embedding when ``start`` is 0 and the head when ``stop`` is the last layer."""

    def __init__(self, model: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        n = len(model.layers)
        self.embedding = model.embedding if start == 0 else None
        self.layers = nn.ModuleList(model.layers[start:stop])
        self.head = model.head if stop == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def chunk_indices(num_layers: int, pp: int, virtual: int, rank: int) -> list[tuple[int, int, int]]:
    """(stage index, first layer, end layer) of each chunk of pipeline rank ``rank``."""
    stages = pp * virtual
    if num_layers % stages:
        raise ValueError(f"{num_layers} layers do not split into {pp} x {virtual} equal chunks")
    per = num_layers // stages
    return [(k, k * per, (k + 1) * per) for k in range(rank, stages, pp)]


def pack_target(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One tensor the schedule splits into micro-batches: [..., 0] the labels, [..., 1] the 0/1 mask."""
    return torch.stack([labels, loss_mask.to(labels.dtype)], dim=-1)


def build_schedule(model: nn.Module, pp: int, virtual: int, rank: int, group: Any, device: torch.device,
                   micro_batches: int, loss_fn: Callable[..., torch.Tensor]) -> tuple[Any, list[Chunk]]:
    """The schedule (``ScheduleInterleaved1F1B`` for ``virtual`` > 1, else ``Schedule1F1B``) over this
    rank's chunks of ``model`` on the pipeline ``group``, with ``loss_fn(logits, labels, loss_mask)`` on
    the last stage's output and ``pack_target``'s target; and the chunks (their parameters are the
    rank's). ``schedule.step(tokens, target=..., losses=[])`` runs one step of ``micro_batches``."""
    chunks, stages = [], []
    for k, start, stop in chunk_indices(len(model.layers), pp, virtual, rank):
        chunk = Chunk(model, start, stop).to(device)
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, k, pp * virtual, device, group=group))

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, target[..., 0], target[..., 1].to(logits.dtype))

    if virtual > 1:
        return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss), chunks
    return Schedule1F1B(stages[0], micro_batches, loss_fn=loss), chunks
