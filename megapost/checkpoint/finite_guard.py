"""Never save or continue from a non-finite state: a NaN/Inf loss, grad norm or parameter stops the run
in one line naming the iteration and the last good checkpoint.

The check is one device-side reduction and one host read, done only at save and log time (training
steps never wait on it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megapost.checkpoint.folder import last_complete


def _finite(t: Any, device: torch.device) -> torch.Tensor:
    """A 1-element bool tensor: every value of ``t`` is finite. One pass, no tensor-sized temporary
    (``aminmax``: a NaN or Inf anywhere shows in the min or the max; ``isfinite().all()`` would allocate
    a mask as large as ``t`` — about 19x slower on a CPU)."""
    t = torch.as_tensor(t, device=device).detach()
    if not t.is_floating_point() or t.numel() == 0:
        return torch.ones(1, dtype=torch.bool, device=t.device)
    return torch.stack(torch.aminmax(t.reshape(-1))).isfinite().all().reshape(1)


def all_finite(tensors: Iterable[Any], device: torch.device, everywhere: bool = True) -> bool:
    """True when every value of every tensor (or number) is finite, on every rank (``everywhere``
    False: on this rank, no collective — e.g. in a background writer thread)."""
    flags = [_finite(t, device) for t in tensors if t is not None]
    ok = torch.cat(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)
    ok = ok.to(torch.float32).reshape(1)
    if everywhere and dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def non_finite_error(what: str, iteration: int, save_dir: str | None) -> FloatingPointError:
    last = last_complete(save_dir)
    where = (f"the last good checkpoint is {last} (resume with --load {save_dir})" if last
             else "no good checkpoint was saved")
    return FloatingPointError(f"{what} at iteration {iteration}; {where}; lower --lr, "
                              "raise --lr-warmup-iters, or check the data (--data-path)")


Named = tuple[str, Any]  # (what it is: a file key such as "fp32/<param>" or "loss", tensor or number)


def non_finite_names(named: Iterable[Named], device: torch.device) -> list[str]:
    """The names of this rank's ``named`` values holding a NaN or Inf (the slow path, after a failed
    :func:`all_finite`: one host read a tensor)."""
    return [name for name, t in named if t is not None and not bool(_finite(t, device).item())]


def _listed(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def refuse_non_finite(written: Iterable[Named], pending: Iterable[Named], iteration: int,
                      save_dir: str | None, device: torch.device, everywhere: bool = True) -> None:
    """Before a save: raise :class:`FloatingPointError` (one line naming the non-finite values, e.g.
    ``fp32/layers.0.mlp.fc1.weight`` or ``loss``) unless every tensor to be ``written`` (fp32 masters,
    optimizer state; never a plugin's record, which may hold a metric undefined for the run as NaN) and
    every ``pending`` loss and norm is finite, everywhere (or, with ``everywhere`` False, on this rank:
    an async save's writer checks its host snapshot so). Each is a ``(name, value)`` pair."""
    named = [*pending, *written]
    if all_finite([t for _, t in named], device, everywhere):
        return
    bad = non_finite_names(named, device)
    rank = f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    found = f"NaN or Inf{rank} in {_listed(bad)}" if bad else "a NaN or Inf on another rank"
    raise non_finite_error(f"not saving a non-finite training state ({found})", iteration, save_dir)
