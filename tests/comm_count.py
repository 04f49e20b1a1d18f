"""Bytes moved by torch.distributed collectives during one optimizer step of the real trainer (gloo,
CPU ranks): a counting wrapper installed over ``torch.distributed``'s collectives before DeepSpeed
binds them (``run_ranks(..., setup=install)``), on only while the counted step runs. For
tests/test_reduce_bytes.py and benchmarks/grad_reduce_bytes.py; never in the product.

Per call it records the buffer the collective works on (``payload``: an all-reduce's or reduce's
tensor, an all-gather's full output, a reduce-scatter's full input) and the bytes a rank sends on a
ring (``wire``): 2(n-1)/n of the payload for an all-reduce, (n-1)/n for the others, n the group size.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from typing import Any

import torch

COUNTED_STEP = 3  # the optimizer step counted (1 and 2 warm up)

# collective -> (which argument holds the buffer, how it is sized, ring factor numerator multiplier)
_SIZED = {
    "all_reduce": (0, "tensor", 2), "reduce": (0, "tensor", 1), "broadcast": (0, "tensor", 1),
    "all_reduce_coalesced": (0, "list", 2), "all_gather_into_tensor": (0, "tensor", 1),
    "_all_gather_base": (0, "tensor", 1), "all_gather": (0, "list", 1),
    "reduce_scatter_tensor": (1, "tensor", 1), "_reduce_scatter_base": (1, "tensor", 1),
    "reduce_scatter": (1, "list", 1),
}
_ARG_NAMES = {0: ("tensor", "tensors", "output_tensor", "tensor_list", "output"),
              1: ("input", "input_tensor", "input_list")}


class Counts:
    def __init__(self) -> None:
        self.enabled = False
        self.payload: dict[str, int] = defaultdict(int)
        self.wire: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_group: dict[tuple[int, ...], float] = defaultdict(float)  # wire bytes per group's ranks


COUNTS = Counts()


def _nbytes(buf: Any, how: str) -> int:
    if how == "list":
        return sum(t.numel() * t.element_size() for t in buf)
    return buf.numel() * buf.element_size()


def _wrap(name: str, fn: Any) -> Any:
    import torch.distributed as dist

    index, how, ring = _SIZED[name]

    def counted(*args: Any, **kwargs: Any) -> Any:
        if COUNTS.enabled:
            buf = args[index] if len(args) > index else next(
                kwargs[k] for k in _ARG_NAMES[index] if k in kwargs)
            n = dist.get_world_size(kwargs.get("group"))
            size = _nbytes(buf, how)
            COUNTS.payload[name] += size
            COUNTS.wire[name] += ring * (n - 1) / n * size
            COUNTS.calls[name] += 1
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(n))
            COUNTS.by_group[ranks] += ring * (n - 1) / n * size
        return fn(*args, **kwargs)

    return counted


def install() -> None:
    """Wrap every sized collective of ``torch.distributed`` (and its ``distributed_c10d`` twin), before
    DeepSpeed's communication backend captures them."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _SIZED:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = _wrap(name, original)
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, wrapped)


def count_step(argv: list[str]) -> dict[str, Any]:
    """Train ``argv`` (megapost.pretrain's flags, on every rank of ``run_ranks``) and return the bytes
    counted during optimizer step ``COUNTED_STEP``, with the rank's parameter count, the engine's
    ZeRO stage and optimizer, the buckets of megapost's overlapped bf16 reduction (0: none) and the
    last step's loss."""
    import torch.distributed as dist
    from step_patch import train_with_step

    def train_step(self: Any, original: Any, step: int) -> Any:
        COUNTS.enabled = step == COUNTED_STEP
        try:
            return original(self, step)
        finally:
            COUNTS.enabled = False

    for d in (COUNTS.payload, COUNTS.wire, COUNTS.calls, COUNTS.by_group):
        d.clear()
    trainer, history = train_with_step(argv, train_step)
    from megapost.ds_adapter.overlap import installed

    engine = trainer.engine.ds  # DeepSpeed's engine under megapost's Engine (the native engine: itself)
    native = not hasattr(engine, "zero_optimization_stage")  # megapost.native (--use-distributed-optimizer)
    overlap = None if native else installed(engine)
    losses = history["train_loss"]
    buckets = len(overlap.buckets) if overlap is not None else 0
    buckets = len(trainer.engine.dist.buckets) if native else buckets
    return {"by_axis": _by_axis(trainer.pstate), "overlap_buckets": buckets,
            "payload": dict(COUNTS.payload), "wire": dict(COUNTS.wire), "calls": dict(COUNTS.calls),
            "params": sum(p.numel() for p in engine.module.parameters()),
            "zero_stage": "native" if native else engine.zero_optimization_stage(),
            "optimizer": "DistributedOptimizer" if native else type(engine.optimizer).__name__,
            "rank": dist.get_rank(), "loss": losses[max(losses)] if losses else None}


def _by_axis(state: Any) -> dict[str, float]:
    """The wire bytes counted, by the axis of the group they ran on (dp, tp, pp, world or other)."""
    import torch.distributed as dist

    axes = {}
    for axis in ("dp", "tp", "pp"):
        group = getattr(state, f"{axis}_group")
        if group is not None:
            axes.setdefault(tuple(dist.get_process_group_ranks(group)), axis)
    axes.setdefault(tuple(range(dist.get_world_size())), "world")
    out: dict[str, float] = defaultdict(float)
    for ranks, wire in COUNTS.by_group.items():
        out[axes.get(ranks, "other")] += wire
    return dict(out)


MODEL = dict(vocab_size=256, num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4,
             seq_length=32)  # 3.3M parameters: the small collectives (loss, norm) are < 0.01 % of a step


def _flag(flags: list[str], name: str) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else 1


def count_runs(runs: list[tuple[int, list[str]]]) -> list[dict[str, Any]]:
    """``count_step`` of each (micro-batches per step, extra flags) in turn at micro-batch 1, on this
    rank (data parallelism: the world over the flags' tensor and pipeline sizes), on the synthetic corpus
    of ``tests/dist_utils``."""
    import shutil

    import torch.distributed as dist
    from dist_utils import RunSpec, _model_flags, tiny_config, write_token_stream

    cfg = tiny_config(**MODEL)
    spec = RunSpec(steps=COUNTED_STEP, global_batch=8 * dist.get_world_size())
    tmp = [tempfile.mkdtemp(prefix="megapost-bytes-") if dist.get_rank() == 0 else None]
    if tmp[0] is not None:
        write_token_stream(os.path.join(tmp[0], "tokens"), spec, cfg)
    dist.broadcast_object_list(tmp, src=0)
    out = []
    try:
        for micro_batches, flags in runs:
            dp = dist.get_world_size() // (_flag(flags, "--tensor-model-parallel-size")
                                           * _flag(flags, "--pipeline-model-parallel-size"))
            argv = [*_model_flags(cfg), "--data-path", os.path.join(tmp[0], "tokens"), "--split", "1,0,0",
                    "--micro-batch-size", "1", "--global-batch-size", str(micro_batches * dp),
                    "--train-iters", str(COUNTED_STEP), "--lr", "1e-3", "--eval-interval", "0",
                    "--log-interval", str(COUNTED_STEP), "--peak-tflops", "1", *flags]
            out.append({"micro_batches": micro_batches, "flags": flags, **count_step(argv)})
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
    return out


def run_counts(runs: list[tuple[int, list[str]]], dp: int = 2, timeout: float = 900
               ) -> list[list[dict[str, Any]]]:
    """``count_runs(runs)`` on ``dp`` gloo ranks (one launch): per rank, per run."""
    from dist_utils import run_ranks

    torch.set_num_threads(1)
    return run_ranks(count_runs, dp, runs, setup=install, timeout=timeout)
