"""The optimizer state a checkpoint holds, in and out through the Engine (``megapost.engine``) only:
what is recorded besides the tensors, the keys a load restores, and setting one local parameter's
master, weight and state from the slices a reader assembled."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megapost.checkpoint.format import MOMENTS
from megapost.engine import MASTER, Engine


def keys_to_load(header: dict[str, Any], optimizer: bool) -> list[str]:
    """The optimizer-state keys a load restores from a tag's state ``header`` (none without
    ``optimizer``; Adam's moments in tags from before the keys were recorded)."""
    if not optimizer:
        return []
    return header.get("state_keys", list(MOMENTS) if header["adam_step"] is not None else [])


def prepare(engine: Engine, header: dict[str, Any], keys: list[str], optimizer: bool) -> None:
    """Zero state under ``keys`` with the saved step count and group settings, ready to be written."""
    if keys or (optimizer and header["adam_step"] is not None):
        engine.init_optimizer_state(keys, header["adam_step"], header.get("param_groups"))


def set_param(engine: Engine, p: nn.Parameter, values: dict[str, torch.Tensor]) -> None:
    """``p``'s weight from ``values[MASTER]`` (this rank's whole local piece) and, of what this rank
    holds (``held_range``), its master and every other ``values`` key as optimizer state."""
    fp32 = values[MASTER].to(p.device)
    with torch.no_grad():
        p.data.copy_(fp32.to(p.dtype))
    held = engine.held_range(p)
    if held is None:
        return
    start, numel = held
    for kind, value in values.items():
        engine.write_state(p, kind, value.to(p.device).reshape(-1).narrow(0, start, numel))
