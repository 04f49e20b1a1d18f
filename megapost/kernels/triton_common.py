"""What the Triton kernels (``triton_norm``, ``triton_rope``, ``triton_swiglu``) share: whether Triton
imports, whether it runs on a device, and the kernels jitted on first use.

Triton is optional. Its kernels run on CUDA, and on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``), which Triton reads when a kernel is defined: ``jitted`` defines each kernel per
state of the variable, so a test can switch it on for itself (the kernels' bodies: ``triton_kernels``)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def available() -> str | None:
    """Triton's version when it imports, else None."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - optional; a broken install is "not available"
        return None
    return str(triton.__version__)


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: CUDA (or any device under the interpreter) with
    Triton importable."""
    return (device.type == "cuda" or interpreted()) and available() is not None


def triton_note(device: torch.device, names: list[str], enabled: bool = True,
                failed: dict[str, str] | None = None) -> str | None:
    """The start-up line of the ``--kernel-fusion`` fusions ``names`` (of "norm", "rope", "swiglu") that
    have a Triton kernel, on ``device`` (``enabled`` False: ``--no-triton-kernels``; ``failed``: the
    fusions whose kernel failed its start-up check, ``triton_check.self_check``); None without any."""
    if not names:
        return None
    flag = f"--kernel-fusion {', '.join(names)}"
    if not enabled:
        return f"{flag}: torch ops on {device.type} (--no-triton-kernels)"
    if runs_on(device):
        failed = {n: e for n, e in (failed or {}).items() if n in names}
        good = [n for n in names if n not in failed]
        parts = [f"--kernel-fusion {', '.join(good)}: Triton kernels on {device.type} (triton {available()}; "
                 "under auto only when not fp32: not bit-identical)"] if good else []
        parts += [f"--kernel-fusion {n}: torch path on {device.type}, its Triton kernel {e} at the start-up "
                  "check" for n, e in failed.items()]
        return "; ".join(parts)
    return (f"{flag}: triton does not import, so on {device.type} the residual add stays apart from torch's "
            "(or apex's) fused RMSNorm, and RoPE and the SwiGLU gate run as torch ops")


# the torch ops of the Triton kernels: a schema and a Python kernel per device, one dispatcher trip (host time
# a call 1.75 us against 7.85 us through torch.library.custom_op's wrapper: benchmarks/op_dispatch.py)
_LIB = torch.library.Library("megapost", "FRAGMENT")


class TorchOp:
    """``megapost::<name>``, defined by ``torch_op``; ``register_fake`` decorates its meta-tensor function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(f"megapost::{self.name}", fake, lib=_LIB)
        return fake


def torch_op(schema: str) -> Callable[[Callable[..., Any]], TorchOp]:
    """Decorator: the function becomes the CPU (Triton's interpreter) and CUDA kernel of the torch op
    ``megapost::<schema>`` (``torch.ops.megapost.<name>``; a dispatch counter sees one op)."""

    def define(fn: Callable[..., Any]) -> TorchOp:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        return TorchOp(name)

    return define


def jitted(name: str) -> Any:
    """The kernel ``triton_kernels.<name>``, jitted under the current ``TRITON_INTERPRET``."""
    return _jitted(name, interpreted())


@functools.cache
def _jitted(name: str, interpret: bool) -> Any:
    import triton

    from megapost.kernels import triton_kernels

    return triton.jit(getattr(triton_kernels, name))


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(tiles: int, device: torch.device) -> int:
    """Programs for a grid-strided kernel over ``tiles`` tiles: a few per SM on CUDA, 3 in the
    interpreter (so that each program loops)."""
    if device.type != "cuda":
        return min(tiles, 3)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(tiles, 4 * _sms(index))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
