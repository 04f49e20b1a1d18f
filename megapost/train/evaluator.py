"""The evaluator: ``--eval-iters`` forward-only steps on the validation split, logged as loss and ppl."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megapost.metrics.monitor import Monitor
from megapost.train.plugin_host import PluginBatches
from megapost.train.step import StepRunner
from megapost.utils.faults import NO_FAULTS, FaultInjector


class Evaluator:
    def __init__(self, runner: StepRunner, valid_iter_fn: Callable[[], Iterator[Any] | None] | None,
                 eval_iters: int, monitor: Monitor, tokens_per_step: int,
                 faults: FaultInjector = NO_FAULTS) -> None:
        self.runner, self.valid_iter_fn, self.eval_iters = runner, valid_iter_fn, eval_iters
        self.faults = faults  # a harness's (tools/fault_pretrain.py): the "eval" point
        self.monitor, self.tokens_per_step = monitor, tokens_per_step

    @torch.no_grad()
    def evaluate(self) -> float:
        it = self.valid_iter_fn() if self.valid_iter_fn is not None else None
        if it is None:
            return math.nan
        runner = self.runner
        engine = runner.engine
        batches = PluginBatches(it, runner.pipeline, runner.device)
        total = torch.zeros((), device=runner.device)
        for i in range(self.eval_iters):
            if i:
                self.faults.point("eval")  # the soak (tools/soak.py): a rank killed between eval batches
            if runner.pipeline:
                # the last stage returns a 0-d loss, the others DeepSpeed's broadcast copy of shape [1]
                loss = engine.forward_only(batches, runner.grad_accum_steps).detach().float().reshape(())
                total += runner.dp_mean(loss)
            else:
                engine.train(False)
                total += runner.micro_losses(batches, backward=False)
                engine.train(True)
        return float(total) / self.eval_iters

    def validate(self, iteration: int, history: dict[str, Any]) -> None:
        """Evaluate, record in ``history["valid_loss"]`` and log at ``iteration``."""
        loss = self.evaluate()
        history["valid_loss"][iteration] = loss
        tokens = iteration * self.tokens_per_step
        self.monitor.scalars("valid", {"lm_loss": loss, "ppl": math.exp(min(loss, 50.0))}, iteration, tokens)
        self.monitor.line(f" validation at iteration {iteration} | lm loss {loss:.4f} | "
                          f"ppl {math.exp(min(loss, 50.0)):.2f}")
