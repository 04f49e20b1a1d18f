"""What one rank writes into a tag of megapost's sharded checkpoint (format 2), and nothing more.

Each rank writes ``layout_free/shard-tpTT-ppPP-dpDD.safetensors``: for every parameter of its
(TP, PP) shard, the part of the flattened fp32 master and optimizer state it owns — its ZeRO partition
(DeepSpeed's per-parameter fragments, ``megapost.ds_adapter.fragments``: (start, numel) in the flattened
parameter, the fp32 master and optimizer-state fragments views of the flat fp32 partition) or, without ZeRO
(each data-parallel rank holds all of it), the whole local tensor from data-parallel rank 0 only —
as 1-D tensors ``fp32/<name>`` and ``<key>/<name>`` for every tensor of ``state[p]`` (Adam: ``exp_avg``,
``exp_avg_sq``; SGD: ``momentum_buffer``), plus the rank's RNG. The
header metadata ``megapost`` (JSON) gives per name the full shape, the TP split (dim, offset), the
local shape and the fragment's (start, numel); any layout reassembles the slices it needs
(``layout_free.ShardIndex``). Weights are the fp32 masters (the bf16 weights are their rounding).
The logging rank also writes ``layout_free/state.safetensors`` (scheduler, counters, config, layout,
the optimizer's state keys and group settings).

Nothing is gathered across ranks: a save's host memory is this rank's own shard (an async snapshot,
taken while the next step's forward and backward run) or nothing but a fixed staging buffer
(synchronous saves stream from the live tensors).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megapost.checkpoint import layout_free as lf
from megapost.checkpoint.layout_free import shard_file_v2 as shard_file
from megapost.checkpoint.stream_write import Staging, write_safetensors
from megapost.ds_adapter import fragments

FORMAT = 2


def all_shard_files(pstate: Any) -> list[str]:
    return [shard_file(t, p, d) for p in range(pstate.pp_size) for t in range(pstate.tp_size)
            for d in range(pstate.dp_size)]


@dataclass
class RankFiles:
    """The files one rank writes for a tag: (relative path, entries, metadata JSON) each."""

    files: list[tuple[str, list[tuple[str, torch.Tensor]], dict[str, Any]]] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor written, in file order (what the finite check before a save scans)."""
        return [t for _, entries, _ in self.files for _, t in entries]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def rank_files(engine: Any, pstate: Any, layout: dict[str, Any], client: dict[str, Any]) -> RankFiles:
    """This rank's files for a tag, as views of the live state (no copy); ``layout``: the run's
    (``layout_free.layout_of``), recorded in the state file."""
    cfg = engine.module.config
    shapes = lf.full_shapes(cfg)
    params = lf.local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    step, keys = lf._adam_step(engine), lf.state_keys(engine)
    if keys:
        lf._link_state(engine)
    entries: list[tuple[str, torch.Tensor]] = []
    meta: dict[str, Any] = {}
    for name, p in params.items():
        owned = fragments.owned_state(engine.optimizer, p, pstate.dp_rank, tuple(keys))
        if owned is None:
            continue
        start, numel, values = owned
        dim, offset = lf.split_of(tuple(p.shape), shapes[name], pstate.tp_rank, pstate.tp_size, name)
        meta[name] = {"shape": list(shapes[name]), "dim": dim, "offset": offset, "local": list(p.shape),
                      "start": start, "numel": numel}
        entries += [(f"{kind}/{name}", v) for kind, v in values.items()]
    rng_tensors: dict[str, torch.Tensor] = {}
    header = {"format": FORMAT, "tp_rank": pstate.tp_rank, "pp_rank": pstate.pp_rank,
              "dp_rank": pstate.dp_rank, "params": meta, "rng": lf._encode(client["rng"], rng_tensors, "rng")}
    entries += sorted(rng_tensors.items())
    out = RankFiles([(os.path.join(lf.DIR, shard_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank)),
                      entries, header)])
    if pstate.is_logging_rank:
        out.files.append(_state_file(engine, pstate, layout, client, step, keys))
    return out


def _state_file(engine: Any, pstate: Any, layout: dict[str, Any], client: dict[str, Any], step: int | None,
                keys: list[str]) -> tuple[str, list[tuple[str, torch.Tensor]], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list,
                                                                             tuple, type(None)))}
              for g in lf._base_optimizer(engine).param_groups]
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    header = {
        "format": FORMAT, "iteration": client["iteration"],
        "consumed_train_samples": client["consumed_train_samples"], "adam_step": step,
        "state_keys": keys, "param_groups": groups,
        "scheduler": scheduler, "model_config": asdict(engine.module.config), "layout": layout,
        "args": client.get("args", {}),
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "skipped_steps": engine.skipped_steps},
        "shards": all_shard_files(pstate),
        "rng": lf._encode(client["rng"], tensors, "rng"),
        "plugins": lf._encode(client["plugins"], tensors, "plugins"),
    }
    return os.path.join(lf.DIR, lf.STATE), sorted(tensors.items()), header


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

    def snapshot(self, files: RankFiles, pause: Any = None) -> Snapshot:
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

    def __init__(self, files: RankFiles, pairs: list[tuple[torch.Tensor, torch.Tensor]], pause: Any) -> None:
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


def write_rank_files(tag_dir: str, files: RankFiles, staging: Staging, pause: Any = None,
                     direct: bool = False) -> int:
    """Write this rank's files into ``tag_dir`` (each atomically; ``direct``: bypassing the page cache
    where the filesystem allows); returns bytes written."""
    total = 0
    for rel, entries, header in files.files:
        total += write_safetensors(os.path.join(tag_dir, rel), entries, {"megapost": json.dumps(header)},
                                   staging, pause=pause, direct=direct)
    return total
