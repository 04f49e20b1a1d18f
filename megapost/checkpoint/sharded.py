"""What one rank writes into a tag of megapost's sharded checkpoint (format 2), and nothing more.

Each rank writes ``layout_free/shard-tpTT-ppPP-dpDD.safetensors``: for every parameter of its
(TP, PP) shard, the part of the flattened fp32 master and Adam moments it owns — its ZeRO partition
(DeepSpeed's ``param._hp_mapping``: ``lp_fragment_address`` (start, numel) in the flattened parameter,
``hp_fragment`` and the optimizer-state fragments views of the flat fp32 partition) or, without ZeRO
(each data-parallel rank holds all of it), the whole local tensor from data-parallel rank 0 only —
as 1-D tensors ``fp32/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, plus the rank's RNG. The
header metadata ``megapost`` (JSON) gives per name the full shape, the TP split (dim, offset), the
local shape and the fragment's (start, numel); any layout reassembles the slices it needs
(``layout_free.ShardIndex``). Weights are the fp32 masters (the bf16 weights are their rounding).
The logging rank also writes ``layout_free/state.safetensors`` (scheduler, counters, config, layout).

Nothing is gathered across ranks: a save's host memory is this rank's own shard (an async snapshot)
or nothing but a fixed staging buffer (synchronous saves stream from the live tensors).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megapost.checkpoint import layout_free as lf
from megapost.checkpoint.layout_free import shard_file_v2 as shard_file
from megapost.checkpoint.stream_write import Staging, write_safetensors

FORMAT = 2


def all_shard_files(pstate: Any) -> list[str]:
    return [shard_file(t, p, d) for p in range(pstate.pp_size) for t in range(pstate.tp_size)
            for d in range(pstate.dp_size)]


@dataclass
class RankFiles:
    """The files one rank writes for a tag: (relative path, entries, metadata JSON) each."""

    files: list[tuple[str, list[tuple[str, torch.Tensor]], dict[str, Any]]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, entries, _ in self.files for _, t in entries)


def _fragments(engine: Any, p: torch.nn.Parameter, dp_rank: int,
               has_state: bool) -> tuple[int, int, dict[str, torch.Tensor]] | None:
    """(start, numel, {kind: 1-D tensor}) this rank owns of ``p`` (flattened), or None."""
    if lf._is_mapped(p):
        mapping = p._hp_mapping
        if mapping is None:
            return None  # this rank's ZeRO partition holds none of p
        address = mapping.lp_fragment_address
        values = {"fp32": mapping.get_hp_fragment()}
        if has_state:
            values.update({k: mapping.get_hp_fragment(k) for k in lf.MOMENTS})
        return address.start, address.numel, {k: v.detach().reshape(-1) for k, v in values.items()}
    if dp_rank != 0:
        return None  # replicated over data parallelism: data-parallel rank 0 writes it
    values = {"fp32": p.detach()}
    if has_state:
        state = lf._base_optimizer(engine).state[p]
        values.update({k: state[k] for k in lf.MOMENTS})
    return 0, p.numel(), {k: v.detach().reshape(-1).float() for k, v in values.items()}


def rank_files(engine: Any, pstate: Any, layout: dict[str, Any], client: dict[str, Any]) -> RankFiles:
    """This rank's files for a tag, as views of the live state (no copy); ``layout``: the run's
    (``layout_free.layout_of``), recorded in the state file."""
    cfg = engine.module.config
    shapes = lf.full_shapes(cfg)
    params = lf.local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    step = lf._adam_step(engine)
    if step is not None:
        lf._link_state(engine)
    entries: list[tuple[str, torch.Tensor]] = []
    meta: dict[str, Any] = {}
    for name, p in params.items():
        owned = _fragments(engine, p, pstate.dp_rank, step is not None)
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
        out.files.append(_state_file(engine, pstate, layout, client, step))
    return out


def _state_file(engine: Any, pstate: Any, layout: dict[str, Any], client: dict[str, Any],
                step: int | None) -> tuple[str, list[tuple[str, torch.Tensor]], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    header = {
        "format": FORMAT, "iteration": client["iteration"],
        "consumed_train_samples": client["consumed_train_samples"], "adam_step": step,
        "scheduler": scheduler, "model_config": asdict(engine.module.config), "layout": layout,
        "args": client.get("args", {}),
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "skipped_steps": engine.skipped_steps},
        "shards": all_shard_files(pstate),
        "rng": lf._encode(client["rng"], tensors, "rng"),
        "plugins": lf._encode(client["plugins"], tensors, "plugins"),
    }
    return os.path.join(lf.DIR, lf.STATE), sorted(tensors.items()), header


class HostPool:
    """Host copies of a rank's files for an async save, reused from save to save (pinned on CUDA)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def _buffer(self, rel: str, name: str, t: torch.Tensor) -> torch.Tensor:
        key = (rel, name)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._buffers[key] = buf
        return buf

    def snapshot(self, files: RankFiles) -> tuple[RankFiles, Any]:
        """(host copy, event to wait on before reading it): device copies are queued on the current
        stream (training's later kernels come after them), host tensors copied now."""
        out = RankFiles()
        on_device = False
        for rel, entries, header in files.files:
            copied = []
            for name, t in entries:
                buf = self._buffer(rel, name, t)
                buf.copy_(t, non_blocking=t.device.type == "cuda")
                on_device |= t.device.type == "cuda"
                copied.append((name, buf))
            out.files.append((rel, copied, header))
        event = None
        if on_device:
            event = torch.cuda.Event()
            event.record()
        return out, event


def write_rank_files(tag_dir: str, files: RankFiles, staging: Staging, event: Any = None,
                     pause: Any = None) -> int:
    """Write this rank's files into ``tag_dir`` (each atomically); returns bytes written."""
    if event is not None:
        event.synchronize()
    total = 0
    for rel, entries, header in files.files:
        total += write_safetensors(os.path.join(tag_dir, rel), entries, {"megapost": json.dumps(header)},
                                   staging, pause=pause)
    return total
