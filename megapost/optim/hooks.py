"""What megapost adds to a DeepSpeed engine (through ``megapost.ds_adapter.step_hooks``): a callback just
before the optimizer step, the sync-free steps that skip a non-finite gradient (counted by a
``SkipCounter``, the lr schedule counting on the device), no gradient "all-reduce" over a
data-parallel group of one rank, and the bf16 ZeRO-1 reduction overlapped with the last micro-batch's
backward (``megapost.ds_adapter.overlap``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megapost.config.errors import ConfigError
from megapost.ds_adapter import overlap as ds_overlap
from megapost.ds_adapter import partial_sums as ds_partial_sums
from megapost.ds_adapter import selftest, step_hooks
from megapost.optim.skips import SkipCounter


def install(engine: Any, before_step: Callable[[], None], dp_size: int | None = None,
            overlap_bucket: int | None = None, skip_limit: int = 0,
            fuse_grad_accumulation: bool = True, partial_sums: tuple[Any, list] | None = None
            ) -> SkipCounter:
    """Install the hooks; with ``dp_size`` 1, skip the engine's data-parallel gradient reduction; with
    ``overlap_bucket`` (megapost.optim.grad_reduce.overlap_bucket), overlap the bf16 reduction in
    buckets of at least that many elements. Returns the counter of skipped steps (``skip_limit``:
    --max-consecutive-skipped-iterations; ``fuse_grad_accumulation``: bf16 gradients added into their
    fp32 buffers without a cast kernel, megapost.ds_adapter.grad_accum; ``partial_sums``: (group,
    parameters) whose gradients are partial sums over that group, summed once per step before
    ``before_step``, megapost.ds_adapter.partial_sums). The adapter's self-test runs first (one line if
    DeepSpeed changed)."""
    problem = selftest.run(engine)
    if problem:
        raise ConfigError(problem)
    if partial_sums is not None:
        group, params = partial_sums
        trainer_before_step = before_step

        def before_step() -> None:
            ds_partial_sums.reduce_once(params, group)
            trainer_before_step()

    skips = SkipCounter(engine.device, skip_limit)
    skips.mode = step_hooks.install(engine, before_step, skips.record, fuse_grad_accumulation)
    skips.skipped_by_deepspeed = lambda: step_hooks.skipped_by_deepspeed(engine)
    scheduler = getattr(engine, "lr_scheduler", None)
    if skips.mode == "device" and hasattr(scheduler, "count_on_device"):
        scheduler.count_on_device(skips.last)
    if dp_size == 1:
        step_hooks.skip_single_rank_reduction(engine)
    elif overlap_bucket is not None:
        why = ds_overlap.unsupported(engine)
        if why:
            raise ConfigError(f"--overlap-grad-reduce with --bf16: the reduction cannot be overlapped here "
                              f"({why}); pass --no-overlap-grad-reduce")
        ds_overlap.install(engine, overlap_bucket)
    return skips


skip_single_rank_reduction = step_hooks.skip_single_rank_reduction
