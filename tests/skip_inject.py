"""Inject a non-finite value into one gradient element at chosen steps of a real training run (the layout
harness's model, data and build path), and record the optimizer state at the start of the steps around
it, read straight from the torch optimizer DeepSpeed steps (its parameters: the fp32 masters or flat fp32
partitions; its state: both Adam moments and the step count), the module weights and the lr schedule.

The gradient is changed by a tensor hook on the first parameter of global rank 0 only (backward calls it
before DeepSpeed reduces or accumulates the gradient): every other rank sees the bad value only through
the reduced gradient or the combined norm.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from megapost.plugin_api import Plugin


@dataclass(frozen=True)
class Case:
    """One run: flags beyond the layout harness's, the steps whose gradient is made non-finite."""

    name: str
    flags: tuple[str, ...] = ()
    inject: tuple[int, ...] = (3,)
    value: float = float("inf")
    steps: int = 5
    watch: tuple[int, ...] = (3, 4, 5)  # steps whose starting state is recorded
    skip_iterations: tuple[int, ...] = ()
    tensorboard: bool = False
    save_interval: int = 0  # also save every this many iterations (3: right after the skipped step)
    extra: dict[str, Any] = field(default_factory=dict)


def optimizer_state(engine: Any) -> dict[str, Any]:
    """Copies of everything a step changes, read from the torch optimizer under DeepSpeed's wrapper."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    params = [p for g in base.param_groups for p in g["params"]]
    state: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        for key, value in base.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"{key}/{i}"] = value.detach().clone()
    lr = engine.get_lr()[0]
    dist = getattr(engine, "dist", None)  # the native engine: its weights' gathers run during the next
    if dist is not None:  # forward; between steps a reader waits for them (docs/multi-gpu.md)
        dist.finish_param_sync()
    return {"masters": [p.detach().float().clone() for p in params],
            "moments": {k: v for k, v in state.items() if not k.startswith("step/")},
            "step": {k: v for k, v in state.items() if k.startswith("step/")},
            "module": [p.detach().float().clone() for p in engine.module.parameters()],
            "num_steps": int(engine.lr_scheduler.state_dict()["num_steps"]),
            "lr": float(lr)}


class InjectNonFinite(Plugin):
    """Records the state at the start of the watched steps; on the injected ones makes one element of
    rank 0's first gradient ``value`` (inf or NaN), and remembers the tokens of every step."""

    name = "inject_non_finite"
    case: Case = Case("unset")
    engine: Any = None

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.states: dict[int, dict[str, Any]] = {}  # at the start of a watched step
        self.after: dict[int, dict[str, Any]] = {}  # after a watched iteration (a skipped one has none)
        self.tokens: dict[int, torch.Tensor] = {}
        self._handle: Any = None

    def wants_step(self, step: int) -> bool:
        return True

    def on_step_begin(self, step: int, model: Any) -> None:
        import torch.distributed as dist

        if step in self.case.watch:
            self.states[step] = optimizer_state(self.engine)
        if step in self.case.inject and dist.get_rank() == 0:
            param = next(p for p in model.parameters() if p.requires_grad)
            value = self.case.value

            def poison(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad.view(-1)[0] = value
                return grad

            self._handle = param.register_hook(poison)

    def after_iteration(self, iteration: int) -> None:
        if iteration in self.case.watch:
            self.after[iteration] = optimizer_state(self.engine)

    def on_micro_batch(self, step: int, batch: dict[str, Any]) -> None:
        self.tokens.setdefault(step, batch["tokens"].clone())

    def on_step_end(self, step: int, loss: float) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def run_case(case: Case) -> dict[str, Any]:
    """Train ``case`` on this rank (call on every rank); its recorded states, skip count, iterations
    done, the stdout of the logging rank and the error line if the run stopped."""
    import torch.distributed as dist
    from dist_utils import RunSpec, layout_argv, tiny_config, write_token_stream

    from megapost.train.build import build
    from megapost.train.prepare import Prepared, prepare

    spec = RunSpec(steps=case.steps, zero_stage=int(case.extra.get("zero", 1)), return_params=False)
    cfg = tiny_config(num_layers=2)
    root = case.extra.get("root")  # a folder kept for a later case to resume from (extra["resume"])
    tmp = [(root or tempfile.mkdtemp(prefix="megapost-skip-")) if dist.get_rank() == 0 else None]
    if tmp[0] is not None and not os.path.exists(os.path.join(tmp[0], "tokens.bin")):
        data = RunSpec(steps=int(case.extra.get("data_steps", case.steps)))  # a resume reads on
        write_token_stream(os.path.join(tmp[0], "tokens"), data, cfg)
    dist.broadcast_object_list(tmp, src=0)
    argv = layout_argv(spec, cfg, os.path.join(tmp[0], "tokens"))
    argv += ["--lr-warmup-iters", str(2 * case.steps), "--log-interval", "2", *case.flags]
    argv += ["--iterations-to-skip", *map(str, case.skip_iterations)] if case.skip_iterations else []
    argv += ["--tensorboard-dir", os.path.join(tmp[0], "tb")] if case.tensorboard else []
    argv += ["--save", os.path.join(tmp[0], "ckpt"), "--save-interval", str(case.save_interval)] \
        if case.save_interval else []
    argv += ["--load", os.path.join(tmp[0], "ckpt")] if case.extra.get("resume") else []
    prep = prepare(argv, dist.get_world_size())
    InjectNonFinite.case = case
    out, error = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        trainer = build(Prepared(prep.args, prep.model, prep.user_ds, [InjectNonFinite]))
        plugin = trainer.plugins[0]
        InjectNonFinite.engine = trainer.engine.ds  # DeepSpeed's engine
        try:
            trainer.train()
        except FloatingPointError as e:
            error = str(e)
        finally:
            trainer.close()
    scalars = {}
    if case.tensorboard and dist.get_rank() == 0:
        from launch_utils import read_scalars

        scalars = read_scalars(os.path.join(tmp[0], "tb"), "train/skipped_iterations")
    dist.barrier()
    if dist.get_rank() == 0 and not root:
        shutil.rmtree(tmp[0], ignore_errors=True)
    return {"states": plugin.states, "after": plugin.after, "skipped": trainer.logger.skips.read()[0],
            "mode": trainer.logger.skips.mode,
            "iterations": trainer.state.iteration, "stdout": out.getvalue(), "error": error,
            "tokens": plugin.tokens, "skipped_scalar": scalars}


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """``run_case`` of each case in turn, in one process group."""
    return [run_case(case) for case in cases]
