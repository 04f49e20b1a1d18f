"""The host copy an ``--async-save`` writes from: one flat buffer per rank, reused from save to save,
filled while the next step's forward and backward run (:class:`HostPool`, :class:`Snapshot`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from megapost.checkpoint.writer import RankFiles

ALIGN = 64  # bytes: every tensor's slice of the flat host buffer starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_bytes(files: RankFiles) -> int:
    """The flat host buffer an async save of ``files`` needs: each tensor's bytes rounded up to ALIGN."""
    return sum(_aligned(t.numel() * t.element_size()) for t in files.tensors())


class HostPool:
    """The host copy of a rank's files for an async save: ONE flat buffer per rank (pinned when CUDA is
    there, a plain one on CPU), exactly ``host_bytes`` long, reused from save to save (per-tensor pinned
    buffers are rounded up to a power of two by torch's host allocator: up to 2x). ``reserve`` allocates
    it ahead of the first save, off its critical path.

    The copy is taken off the training thread's critical path: host tensors are copied by the
    background writer while the next step's forward and backward run (the optimizer step waits for the
    copy: :meth:`Snapshot.wait`); device tensors are copied on a side stream that the next optimizer
    step's stream waits on (no host synchronisation)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held (pinned on CUDA) between saves."""
        return 0 if self._flat is None else self._flat.numel()

    def reserve(self, files: RankFiles) -> torch.Tensor:
        """The flat buffer for ``files``, allocated once (again only if the rank's files change size)."""
        need = host_bytes(files)
        if self._flat is None or self._flat.numel() != need:
            self._flat = None  # free the old one first
            self._flat = torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if not self._flat.is_pinned():
                self._flat.zero_()  # fault its pages in now, not during the first save's copy
        return self._flat

    def snapshot(self, files: RankFiles, pause: Callable[[], None] | None = None) -> Snapshot:
        """The host copy of ``files`` to be (queued on device now; on host: :meth:`Snapshot.take`)."""
        flat, offset = self.reserve(files), 0
        out, pairs = RankFiles(), []
        for rel, entries, header in files.files:
            copied = []
            for name, t in entries:
                n = t.numel() * t.element_size()
                buf = flat[offset:offset + n].view(t.dtype).view(t.shape)
                offset += _aligned(n)
                pairs.append((buf, t))
                copied.append((name, buf))
            out.files.append((rel, copied, header))
        return Snapshot(out, pairs, pause)


class Snapshot:
    """A pending host copy: ``take()`` (the writer thread) copies, ``wait()`` (the training thread,
    before anything changes the state) blocks until it is taken — or, for device tensors, makes the
    current stream wait for the side-stream copies. The writer reads the copy event before it lets
    training go on and never depends on what ``wait()`` does to it, so it cannot skip the event."""

    def __init__(self, files: RankFiles, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 pause: Callable[[], None] | None) -> None:
        self.files, self._pause = files, pause
        self._host = [(b, t) for b, t in pairs if t.device.type != "cuda"]
        self._taken = threading.Event()
        self._event = None
        self._ordered = False  # the training stream waits on the event (wait() ran)
        device = [(b, t) for b, t in pairs if t.device.type == "cuda"]
        self.device = device[0][1].device if device else None  # the owning rank's GPU
        if device:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for buf, t in device:
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(stream)
                self._event = torch.cuda.Event()
                self._event.record(stream)
        if not self._host:
            self._taken.set()

    def take(self) -> None:
        """Copy the host tensors (the writer thread), then let training change them again; return once
        the device copies are on the host. Sets the rank's device first: a thread starts on GPU 0, and a
        CUDA call there would make a context on GPU 0 for every other local rank."""
        if self.device is not None:
            torch.cuda.set_device(self.device)
        event = self._event  # read before _taken.set(): after it the training thread moves on
        try:
            for i, (buf, t) in enumerate(self._host):
                buf.copy_(t)
                if i == 0 and self._pause is not None:
                    self._pause()
        finally:
            self._taken.set()
        if event is not None:
            event.synchronize()  # the device copies are on the host before the write reads them

    def wait(self) -> None:
        self._taken.wait()
        if self._event is not None and not self._ordered:
            torch.cuda.current_stream().wait_event(self._event)
            self._ordered = True


