"""A second Engine (``megapost.engine``) for unit tests of the checkpoint: a plain torch model and
``torch.optim.AdamW``, no DeepSpeed and no process group — what a native engine would be, in one
process. Each optimizer step is real (random gradients)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megapost.config.errors import ConfigError
from megapost.engine import MASTER, Fragment
from megapost.model import LlamaModel, ModelConfig

JSONABLE = (int, float, str, bool, list, tuple, type(None))


class FakeEngine:
    def __init__(self, cfg: ModelConfig, seed: int = 0, lr: float = 1e-2) -> None:
        torch.manual_seed(seed)
        self._module = LlamaModel(cfg)
        self.optimizer = torch.optim.AdamW(self._module.parameters(), lr=lr, betas=(0.8, 0.9))
        self.schedule = {"last_epoch": 0, "base_lr": lr}
        self._counters = {"global_steps": 0, "global_samples": 0, "skipped_steps": 0}

    @property
    def module(self) -> nn.Module:
        return self._module

    def train_steps(self, n: int, seed: int = 1) -> None:
        """``n`` optimizer steps with random gradients."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for p in self._module.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            self.optimizer.step()
            self.schedule["last_epoch"] += 1
            self._counters["global_steps"] += 1
            self._counters["global_samples"] += 4

    # the trainer's side: not used by the checkpoint
    def forward_backward(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        raise NotImplementedError

    def forward_only(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        raise NotImplementedError

    def train(self, mode: bool = True) -> None:
        self._module.train(mode)

    def step(self) -> torch.Tensor:
        raise NotImplementedError

    def lr(self) -> float | torch.Tensor:
        return self.optimizer.param_groups[0]["lr"]

    def grad_norm(self) -> float | torch.Tensor | None:
        return None

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        pass

    # the checkpoint's side
    def owned_state(self, param: nn.Parameter, keys: tuple[str, ...]) -> Fragment | None:
        state = self.optimizer.state[param]
        values = {MASTER: param.detach().reshape(-1), **{k: state[k].reshape(-1) for k in keys}}
        return 0, param.numel(), values

    def write_state(self, param: nn.Parameter, key: str, value: torch.Tensor) -> None:
        target = param if key == MASTER else self.optimizer.state[param][key]
        with torch.no_grad():
            target.copy_(value.reshape(target.shape))

    def optimizer_header(self) -> dict[str, Any]:
        states = self.optimizer.state.values()
        step = next((int(s["step"]) for s in states if "step" in s), None)
        keys = sorted({k for s in states for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, JSONABLE)}
                  for g in self.optimizer.param_groups]
        return {"step": step, "keys": keys, "groups": groups}

    def init_optimizer_state(self, keys: list[str], step: int | None,
                             groups: list[dict[str, Any]] | None) -> None:
        for p in self._module.parameters():
            counted = {} if step is None else {"step": torch.tensor(float(step))}
            self.optimizer.state[p] = {**counted, **{k: torch.zeros_like(p) for k in keys}}
        for group, settings in zip(self.optimizer.param_groups, groups or [], strict=False):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()
                          if k in group and k not in ("lr", "initial_lr")})

    def held_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        return 0, param.numel()

    def partitioned(self) -> bool:
        return False

    def rebuild_weights(self) -> None:
        pass

    def scheduler_state(self) -> dict[str, Any] | None:
        return dict(self.schedule)

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.schedule = dict(state)

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def set_counters(self, counters: dict[str, int]) -> None:
        self._counters = dict(counters)

    def save_native(self, directory: str, tag: str, client: dict[str, Any]) -> None:
        raise ConfigError("--ckpt-format deepspeed: this engine has no files of its own")

    def load_native(self, directory: str, tag: str, optimizer: bool,
                    module_only: bool) -> dict[str, Any] | None:
        return None
