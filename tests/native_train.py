"""Helpers of tests/test_native_engine.py that run in the ranks: the real trainer on the native engine
(``--use-distributed-optimizer``), built as users build it (``build(prepare(argv))``), traced."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

NATIVE = ("--use-distributed-optimizer",)


def small_buckets(numel: int = 20_000) -> None:
    """``run_ranks`` setup: the native engine's buckets of ``numel`` elements (several on the tiny model)."""
    import megapost.native.build as native

    native.BUCKET_NUMEL = numel


@contextlib.contextmanager
def native_trainer(steps: int, global_batch: int, flags: tuple[str, ...]) -> Iterator[Any]:
    """The trainer of the layout harness's tiny model and corpus on the native engine (every rank),
    closed and its corpus removed on exit."""
    import torch.distributed as dist
    from dist_utils import RunSpec, layout_argv, tiny_config, write_token_stream

    from megapost.train.build import build
    from megapost.train.prepare import prepare

    spec = RunSpec(steps=steps, global_batch=global_batch, micro_batch=2, flags=(*NATIVE, *flags))
    cfg = tiny_config()
    tmp = [tempfile.mkdtemp(prefix="megapost-native-") if dist.get_rank() == 0 else None]
    if tmp[0] is not None:
        write_token_stream(os.path.join(tmp[0], "tokens"), spec, cfg)
    dist.broadcast_object_list(tmp, src=0)
    trainer = build(prepare(layout_argv(spec, cfg, os.path.join(tmp[0], "tokens")), dist.get_world_size()))
    try:
        yield trainer
    finally:
        trainer.close()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)


def trace_trainer(flags: tuple[str, ...], micro_batches: int = 2) -> dict[str, Any]:
    """Steps 1 and 2 of the trainer on the native engine; the events of step 2 in issue order: the
    optimizer's collectives ("all_gather i", "reduce_scatter i", its ``trace``), each parameterised
    module's "forward start/end NAME" and each "grad NAME" as its gradient is accumulated; the modules
    of each bucket."""
    import torch.distributed as dist
    from dist_opt_train import record_compute

    events: list[str] = []
    with native_trainer(2, 2 * micro_batches * dist.get_world_size(), flags) as trainer:
        engine = trainer.engine
        names = record_compute(engine.module, events)
        engine.dist.trace = events.append
        trainer.train_step(1)
        events.clear()
        trainer.train_step(2)
        engine.dist.finish_param_sync()
    buckets = [sorted({names[m] for m in names for p in m.parameters(recurse=False)
                       if any(p is q for q in b.params)}) for b in engine.dist.buckets]
    return {"events": list(events), "buckets": buckets}


def check_overlap(events: list[str], buckets: list[list[str]]) -> None:
    """Bucket i+1's all-gather issued before the forward of bucket i ends (every i), in the first
    micro-batch's forward; the last bucket's reduce-scatter issued before the first bucket's gradients
    are in (before the backward ends)."""
    assert len(buckets) >= 3, buckets
    forward = events[:next(j for j, e in enumerate(events) if e.startswith("grad "))]
    for i in range(len(buckets) - 1):
        end_i = max(j for j, e in enumerate(forward) if e in {f"forward end {n}" for n in buckets[i]})
        assert f"all_gather {i + 1}" in forward and forward.index(f"all_gather {i + 1}") < end_i, (i, forward)
    first_grads = max(j for j, e in enumerate(events) if e in {f"grad {n}" for n in buckets[0]})
    last = f"reduce_scatter {len(buckets) - 1}"
    assert last in events and events.index(last) < first_grads, events


def params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def counted_native_setup() -> None:
    """``run_ranks`` setup of benchmarks/dist_opt_bytes.py: the collectives counted (tests/comm_count),
    the native engine's buckets of 500 k elements (7 on its model)."""
    from comm_count import install

    install()
    small_buckets(500_000)


def rollback_losses(flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """The plugins' in-memory rollback on the native engine: after step 1 a ``trainer.snapshot()``,
    steps 2-3, ``trainer.restore``, steps 2-3 again (the same batches): both runs' losses and norms."""
    import torch.distributed as dist

    runs: list[list[float]] = []
    batch = 4 * dist.get_world_size()
    with native_trainer(3, batch, flags) as trainer:
        trainer.train_step(1)
        trainer.state.iteration, trainer.state.consumed_samples = 1, batch
        snap = trainer.snapshot()
        for _ in range(2):
            runs.append([float(trainer.train_step(s)) for s in (2, 3)]
                        + [float(trainer.engine.grad_norm())])
            trainer.restore(snap)
    return {"runs": runs}
