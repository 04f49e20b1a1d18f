"""A safetensors file written one tensor at a time, never holding a second copy of the state on the host.

``safetensors.torch.save_file`` turns every tensor into ``bytes`` before writing (a full host copy of
the file). :func:`write_safetensors` writes the same format (8-byte little-endian header length, JSON
header, raw little-endian tensor bytes; read back with ``safetensors.safe_open``): host tensors go to
the file straight from their memory; device tensors through one fixed staging buffer, in chunks. A full
disk raises ``OSError`` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence

import torch

from megapost.utils.atomic import atomic_path

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
STAGING_BYTES = 64 << 20  # the fixed host buffer device tensors pass through


def _header(entries: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in entries:
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Staging:
    """One reusable host buffer (pinned when CUDA is there) for device -> file copies."""

    def __init__(self, nbytes: int = STAGING_BYTES) -> None:
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._buf


def _write_tensor(f, t: torch.Tensor, staging: Staging) -> None:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    if raw.device.type == "cpu":
        f.write(memoryview(raw.numpy()))
        return
    buf = staging.buffer()
    for start in range(0, raw.numel(), staging.nbytes):
        chunk = raw[start:start + staging.nbytes]
        host = buf[: chunk.numel()]
        host.copy_(chunk)  # blocking: the buffer is reused by the next chunk
        f.write(memoryview(host.numpy()))


def write_safetensors(path: str, entries: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str],
                      staging: Staging | None = None, fsync: bool = True,
                      pause: Callable[[], None] | None = None) -> int:
    """Write ``entries`` (name, tensor) to ``path`` atomically (temp name, then rename); returns bytes.
    ``pause`` (tests) runs after the first tensor, with the file half written."""
    staging = staging or Staging()
    with atomic_path(path, fsync=fsync) as tmp:
        try:
            with open(tmp, "wb") as f:
                f.write(_header(entries, metadata))
                for i, (_, t) in enumerate(entries):
                    _write_tensor(f, t, staging)
                    if i == 0 and pause is not None:
                        f.flush()
                        pause()
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from e
    return os.path.getsize(path)
