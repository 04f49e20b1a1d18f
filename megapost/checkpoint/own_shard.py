"""Resume reading only what a rank holds: its own shard file at the layout a tag was saved at, the byte
ranges of the saved fragments overlapping its own partition at another data-parallel layout.

When the Engine partitions every master over data-parallel ranks (``Engine.partitioned``: ZeRO 1/2 and
the bf16 optimizer under DeepSpeed), at the same (TP, PP, DP, ZeRO stage, bf16, SP) layout every rank's
fp32 master and optimizer-state fragments are exactly what it wrote (:mod:`megapost.checkpoint.writer`),
so it copies them from its own file (``Engine.write_state``) and the weights are rebuilt with the
engine's own all-gather (``Engine.rebuild_weights``, what a step ends with) — instead of assembling
every full parameter from every data-parallel rank's file. An engine that keeps its parameters whole
(ZeRO-0 fp32, written once by data-parallel rank 0) loads through :class:`reader.ShardIndex`.

At another layout with the same tensor split of every local parameter (TP and PP sizes as saved; DP,
ZeRO stage 1/2, bf16 free), each rank reads, of every saved fragment overlapping its partition's
(start, numel), only the overlapping elements (``get_slice``: those bytes of the file). Other layouts
(a new TP split) assemble the TP pieces they need from every file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from megapost.checkpoint import codec
from megapost.checkpoint.format import DIR, STATE, shard_file
from megapost.checkpoint.reader import Piece, RankTensors, ShardIndex
from megapost.checkpoint.specs import full_shapes, local_spec
from megapost.config.errors import ConfigError
from megapost.engine import MASTER, Engine


def load(engine: Engine, pstate: Any, tag_dir: str, header: dict[str, Any], params: dict[str, Any],
         keys: list[str], layout: dict[str, Any] | None = None) -> Any:
    """With every master partitioned, copy this rank's fragments (fp32 and ``keys``) and return its RNG:
    at ``layout`` (this run's) = the tag's from its own file only, at another from the byte ranges that
    hold them (:func:`load_ranges`); None where neither applies (then the assembled path)."""
    if not (header.get("format", 1) >= 2 and params and engine.partitioned()):
        return None
    if layout is None or header.get("layout") != layout:
        return load_ranges(engine, pstate, tag_dir, params, keys)
    path = os.path.join(tag_dir, DIR, shard_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank))
    with safe_open(path, framework="pt") as f, torch.no_grad():
        head = json.loads(f.metadata()["megapost"])
        for name, p in params.items():
            address = engine.held_range(p)
            if address is None:
                continue  # none of p in this rank's partition: the all-gather brings it
            saved = head["params"].get(name)
            if saved is None or (saved["start"], saved["numel"]) != address:
                raise ConfigError(f"--load {path}: the fragment of {name} differs from this rank's "
                                  "partition at the same layout; load it at another layout or report this")
            for kind in (MASTER, *keys):
                engine.write_state(p, kind, f.get_tensor(f"{kind}/{name}"))
        rng = codec.decode(head["rng"], {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng")})
    engine.rebuild_weights()  # the bf16/module weights, all-gathered
    return rng


def _own_pieces(index: ShardIndex, engine: Engine, pstate: Any,
                params: dict[str, Any]) -> dict[str, Piece] | None:
    """name -> the saved TP piece this rank's local parameter is, complete in the tag; None when some
    local parameter is split differently (a new TP size) or the model differs (the assembled path says)."""
    shapes = full_shapes(engine.module.config)
    if shapes != index.shapes:
        return None
    pieces = {}
    for name, p in params.items():
        _, offset = local_spec(p, shapes[name], pstate.tp_rank, pstate.tp_size, name)
        piece = index.pieces[name].get(offset)
        if piece is None or piece.local != tuple(p.shape) or \
                sum(n for _, _, n in piece.frags) != p.numel():
            return None
        pieces[name] = piece
    return pieces


def _read_range(index: ShardIndex, key: str, piece: Piece, start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of ``piece``'s flattened ``key``, read from the saved fragments that
    overlap them, only the overlapping elements of each."""
    parts = []
    for path, s, n in sorted(piece.frags, key=lambda f: f[1]):
        lo, hi = max(start, s), min(start + numel, s + n)
        if lo < hi:
            parts.append(index.open(path).get_slice(key)[lo - s:hi - s])
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if out.numel() != numel:
        raise ConfigError(f"{key}: the checkpoint's fragments hold {out.numel()} of the {numel} values this "
                          "rank owns; is a shard file missing?")
    return out


def load_ranges(engine: Engine, pstate: Any, tag_dir: str, params: dict[str, Any], keys: list[str]) -> Any:
    """At another data-parallel layout with the saved TP split: this rank's fragments (fp32 and ``keys``)
    from the byte ranges that hold them; returns the run's RNG, or None when the split differs."""
    index = ShardIndex(tag_dir)
    pieces = _own_pieces(index, engine, pstate, params)
    if pieces is None:
        return None
    with torch.no_grad():
        for name, p in params.items():
            address = engine.held_range(p)
            if address is None:
                continue  # none of p in this rank's partition: the all-gather brings it
            for kind in (MASTER, *keys):
                engine.write_state(p, kind, _read_range(index, f"{kind}/{name}", pieces[name], *address))
    engine.rebuild_weights()
    return codec.decode(index.header["rng"], RankTensors(index, os.path.join(tag_dir, DIR, STATE)))
