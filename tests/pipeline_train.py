"""Rank functions of tests/test_native_pipeline.py: megapost's model trained through
``megapost.native.pipeline`` (torch.distributed.pipelining) on gloo ranks, and its single-process
reference."""

from __future__ import annotations

from typing import Any

import torch
from dist_utils import RunSpec, synthetic_micro_batch, tiny_config

STEPS, MICRO_BATCHES = 3, 4
SPEC = RunSpec(micro_batch=2)


def _model_and_loss() -> tuple[torch.nn.Module, Any]:
    from megapost.model.llama import LlamaModel
    from megapost.parallel.build import make_loss_fn
    from megapost.parallel.state import ParallelState

    torch.manual_seed(0)
    return LlamaModel(tiny_config()), make_loss_fn(ParallelState())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's ``MICRO_BATCHES`` micro-batches, concatenated (the schedule splits them again)."""
    parts = [synthetic_micro_batch(SPEC, tiny_config(), step, i) for i in range(MICRO_BATCHES)]
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))  # type: ignore[return-value]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)


def pipeline_losses(virtual: int) -> dict[str, Any]:
    """``STEPS`` steps on this world's pipeline ranks with ``virtual`` chunks per rank: each step's mean
    micro-batch loss (on the rank holding the last stage, else None) and the issue order of the chunks'
    forwards of step 1 (stage index per call)."""
    import torch.distributed as dist

    from megapost.native.pipeline import build_schedule, pack_target

    model, loss_fn = _model_and_loss()
    rank, pp = dist.get_rank(), dist.get_world_size()
    schedule, chunks = build_schedule(model, pp, virtual, rank, dist.group.WORLD, torch.device("cpu"),
                                      MICRO_BATCHES, loss_fn)
    order: list[int] = []
    for k, chunk in zip(range(rank, pp * virtual, pp), chunks, strict=True):
        chunk.register_forward_pre_hook(lambda *_a, k=k: order.append(k))
    opt = _optimizer([p for c in chunks for p in c.parameters()])
    out = []
    for step in range(1, STEPS + 1):
        tokens, labels, mask = _batch(step)
        losses: list[torch.Tensor] = []
        opt.zero_grad()
        schedule.step(tokens if rank == 0 else None, target=pack_target(labels, mask), losses=losses)
        opt.step()
        out.append(float(torch.stack(losses).detach().mean()) if losses else None)
    return {"losses": out, "forward_order": order[: virtual * MICRO_BATCHES]}


def reference_losses() -> list[float]:
    """The same steps on the whole model in one process (each micro-batch's loss over their count)."""
    model, loss_fn = _model_and_loss()
    opt = _optimizer(model.parameters())
    out = []
    for step in range(1, STEPS + 1):
        tokens, labels, mask = _batch(step)
        opt.zero_grad()
        losses = []
        for t, y, m in zip(*(x.chunk(MICRO_BATCHES) for x in (tokens, labels, mask)), strict=True):
            loss = loss_fn(model(t), y, m)
            (loss / MICRO_BATCHES).backward()
            losses.append(loss.detach())
        opt.step()
        out.append(float(torch.stack(losses).mean()))
    return out
