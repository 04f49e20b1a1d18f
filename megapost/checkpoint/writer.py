"""What one rank writes into a tag (:mod:`megapost.checkpoint.format`), and nothing more.

Each rank writes ``layout_free/shard-tpTT-ppPP-dpDD.safetensors``: for every parameter of its (TP, PP)
shard, the part of the flattened fp32 master and optimizer state it owns (``Engine.owned_state``: its
ZeRO partition, or without ZeRO the whole local tensor from data-parallel rank 0 only) as 1-D tensors
``fp32/<name>`` and ``<key>/<name>``, with the split its layer declared (the shard spec), plus the
rank's RNG. The logging rank also writes ``layout_free/state.safetensors``. Weights are the fp32
masters (the bf16 weights are their rounding).

Nothing is gathered across ranks: a save's host memory is this rank's own shard (an async snapshot,
:mod:`megapost.checkpoint.snapshot`) or nothing but a fixed staging buffer (synchronous saves stream
from the live tensors, :mod:`megapost.checkpoint.stream_write`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megapost.checkpoint import codec
from megapost.checkpoint.format import DIR, FORMAT, STATE, all_shard_files, shard_file
from megapost.checkpoint.specs import full_shapes, local_parameters, local_spec
from megapost.checkpoint.stream_write import Staging, write_safetensors
from megapost.engine import Engine

PLUGINS = "plugins"  # the key prefix of the plugins' tensors in the state file
File = tuple[str, list[tuple[str, torch.Tensor]], dict[str, Any]]  # (relative path, entries, header)


@dataclass
class RankFiles:
    """The files one rank writes for a tag."""

    files: list[File] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor written, in file order (what the finite check before a save scans)."""
        return [t for _, entries, _ in self.files for _, t in entries]

    def training_state(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors written, by key, less the plugins' records (what the finite check before a save
        scans: a plugin may record a metric undefined for the run -- Hybrid's, DyT's -- as NaN)."""
        return [(key, t) for _, entries, _ in self.files for key, t in entries
                if not key.startswith(PLUGINS + ".")]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def rank_files(engine: Engine, pstate: Any, layout: dict[str, Any], client: dict[str, Any]) -> RankFiles:
    """This rank's files for a tag, as views of the live state (no copy); ``layout``: the run's
    (``format.layout_of``), recorded in the state file."""
    cfg = engine.module.config
    shapes = full_shapes(cfg)
    params = local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    optim = engine.optimizer_header()
    entries: list[tuple[str, torch.Tensor]] = []
    meta: dict[str, Any] = {}
    for name, p in params.items():
        owned = engine.owned_state(p, tuple(optim["keys"]))
        if owned is None:
            continue
        start, numel, values = owned
        spec, offset = local_spec(p, shapes[name], pstate.tp_rank, pstate.tp_size, name)
        meta[name] = {"shape": list(shapes[name]), "spec": spec.to_json(), "dim": spec.dim, "offset": offset,
                      "local": list(p.shape), "start": start, "numel": numel}
        entries += [(f"{kind}/{name}", v) for kind, v in values.items()]
    rng_tensors: dict[str, torch.Tensor] = {}
    header = {"format": FORMAT, "tp_rank": pstate.tp_rank, "pp_rank": pstate.pp_rank,
              "dp_rank": pstate.dp_rank, "params": meta,
              "rng": codec.encode(client["rng"], rng_tensors, "rng")}
    entries += sorted(rng_tensors.items())
    out = RankFiles([(os.path.join(DIR, shard_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank)),
                      entries, header)])
    if pstate.is_logging_rank:
        out.files.append(_state_file(engine, pstate, layout, client, optim))
    return out


def _state_file(engine: Engine, pstate: Any, layout: dict[str, Any], client: dict[str, Any],
                optim: dict[str, Any]) -> File:
    tensors: dict[str, torch.Tensor] = {}
    header = {
        "format": FORMAT, "iteration": client["iteration"],
        "consumed_train_samples": client["consumed_train_samples"], "adam_step": optim["step"],
        "state_keys": optim["keys"], "param_groups": optim["groups"],
        "scheduler": engine.scheduler_state(), "model_config": asdict(engine.module.config), "layout": layout,
        "args": client.get("args", {}),
        "engine": engine.counters(),
        "shards": all_shard_files(pstate),
        "rng": codec.encode(client["rng"], tensors, "rng"),
        "plugins": codec.encode(client["plugins"], tensors, PLUGINS),
    }
    return os.path.join(DIR, STATE), sorted(tensors.items()), header


def write_rank_files(tag_dir: str, files: RankFiles, staging: Staging,
                     pause: Callable[[], None] | None = None, direct: bool = False) -> int:
    """Write this rank's files into ``tag_dir`` (each atomically; ``direct``: bypassing the page cache
    where the filesystem allows); returns bytes written."""
    total = 0
    for rel, entries, header in files.files:
        total += write_safetensors(os.path.join(tag_dir, rel), entries, {"megapost": json.dumps(header)},
                                   staging, pause=pause, direct=direct)
    return total
