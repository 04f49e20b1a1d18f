"""Drive the real trainer (``megapost.pretrain.run``) and count the host syncs of two non-logging
steps (``HostSyncCounter``): counting starts when iteration 3 begins and stops when iteration 5 begins,
so it covers two whole loop iterations (engine step, scheduler, loop bookkeeping) and nothing else."""

from __future__ import annotations

from typing import Any

from dist_utils import run_ranks

COUNTED = (3, 5)  # [first counted iteration, first iteration not counted)
ITERATIONS = "loop iterations counted"  # the audit's own entry: 2 (the counter did run)


def _audit(argv: list[str]) -> dict[str, int]:
    from megapost.metrics.host_syncs import HostSyncCounter
    from megapost.pretrain import run
    from megapost.train.trainer import Trainer

    counter = HostSyncCounter()
    original = Trainer._step  # one whole loop iteration: what the training loop calls

    iterations = []

    def step(self: Trainer, history: Any) -> Any:
        if self.state.iteration + 1 == COUNTED[0]:
            counter.__enter__()
        elif self.state.iteration + 1 == COUNTED[1]:
            counter.__exit__(None, None, None)
        if counter.active:
            iterations.append(self.state.iteration + 1)
        return original(self, history)

    Trainer._step = step  # type: ignore[method-assign]
    try:
        run(argv)
    finally:
        Trainer._step = original  # type: ignore[method-assign]
        if counter.active:
            counter.__exit__(None, None, None)
    return {ITERATIONS: len(iterations), **counter.sites}


def count_syncs(data: Any, world: int, flags: list[str]) -> list[dict[str, int]]:
    """Every rank's ``{"kind @ call site": count}`` over iterations 3 and 4 of a 5-step run that logs
    only at its end (no eval, no save), and ``ITERATIONS``: how many loop iterations were counted."""
    argv = ["--data-path", str(data.prefix), "--tokenizer-model", str(data.tokenizer_model),
            "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--train-iters", "5", "--log-interval", "100", "--eval-interval", "0", "--peak-tflops", "1",
            "--lr-warmup-iters", "1", "--seed", "7", *flags]
    return run_ranks(_audit, world, argv, timeout=600)
