"""Reading a tag's layout-free state (:mod:`megapost.checkpoint.format`) at any layout.

:class:`ShardIndex` knows where each slice of each full parameter lives among the shard files and reads
exactly the slices asked for; :func:`load_layout_free` sets this rank's weights, masters and optimizer
state through the Engine — at the saving layout (or another data-parallel one with the saved TP split)
from only the bytes this rank holds (:mod:`megapost.checkpoint.own_shard`), else by assembling the TP
pieces it needs from every file. Each saved piece's place comes from its recorded spec
(:func:`megapost.checkpoint.specs.piece_split`), each local parameter's from its layer's declaration.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from megapost.checkpoint import codec, optimizer_state
from megapost.checkpoint.format import DIR, read_state, shard_file
from megapost.checkpoint.specs import full_shapes, local_parameters, local_spec, piece_split
from megapost.config.errors import ConfigError
from megapost.engine import MASTER, Engine

Read = Callable[[str, str, "int | None", int, "int | None"], torch.Tensor]


@dataclass
class Piece:
    """One TP piece of a parameter: its split, local shape, and the files holding its flat fragments."""

    dim: int | None
    offset: int
    local: tuple[int, ...]
    tp_rank: int
    frags: list[tuple[str, int, int]] = field(default_factory=list)  # (path, start, numel)


class ShardIndex:
    """Where each slice of each full parameter lives among the shard files of one tag (format 1: one
    file per (TP, PP) rank, full over DP; 2 on: one per rank, its ZeRO fragments)."""

    def __init__(self, tag_dir: str) -> None:
        header, _ = read_state(tag_dir)
        self.header = header
        self.paths = [os.path.join(tag_dir, DIR, name) for name in header["shards"]]
        self.pieces: dict[str, dict[int, Piece]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._files: dict[str, Any] = {}
        for path in self.paths:
            head = json.loads(self.open(path).metadata()["megapost"])
            for name, m in head["params"].items():
                self.shapes[name] = tuple(m["shape"])
                local = tuple(m["local"]) if "local" in m else \
                    tuple(self.open(path).get_slice(f"fp32/{name}").get_shape())
                dim, offset = piece_split({**m, "local": list(local)}, head["tp_rank"])
                piece = self.pieces.setdefault(name, {}).setdefault(
                    offset, Piece(dim, offset, local, head["tp_rank"]))
                if piece.tp_rank == head["tp_rank"]:  # a piece replicated over TP ranks: read one copy
                    numel = m.get("numel", math.prod(local))
                    piece.frags.append((path, m.get("start", 0), numel))

    def open(self, path: str) -> Any:
        """The open safetensors file at ``path`` (kept open for the index's life)."""
        if path not in self._files:
            self._files[path] = safe_open(path, framework="pt")
        return self._files[path]

    def rank_header(self, tp_rank: int, pp_rank: int, dp_rank: int) -> dict[str, Any] | None:
        """The header of one rank's shard file (format 2 on), None when the tag has none for it."""
        path = os.path.join(os.path.dirname(self.paths[0]), shard_file(tp_rank, pp_rank, dp_rank))
        return json.loads(self.open(path).metadata()["megapost"]) if path in self.paths else None

    def get(self, path: str, key: str) -> torch.Tensor:
        return self.open(path).get_tensor(key)

    def _assemble(self, kind: str, name: str, piece: Piece) -> torch.Tensor:
        numel = math.prod(piece.local)
        parts = sorted((start, n, path) for path, start, n in piece.frags)
        if sum(n for _, n, _ in parts) != numel:
            raise ConfigError(f"{name}: the checkpoint's shards hold {sum(n for _, n, _ in parts)} of its "
                              f"{numel} values (TP offset {piece.offset}); is a shard file missing?")
        if len(parts) == 1:
            return self.get(parts[0][2], f"{kind}/{name}").reshape(piece.local)
        return torch.cat([self.get(path, f"{kind}/{name}").reshape(-1) for _, _, path in parts]
                         ).reshape(piece.local)

    def read(self, kind: str, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """``kind/name`` restricted to ``[start, stop)`` along ``dim`` (None: the full tensor)."""
        full = self.shapes[name]
        pieces = sorted(self.pieces[name].values(), key=lambda p: p.offset)
        sdim = pieces[0].dim
        if dim is None:
            dim, start, stop = 0, 0, full[0] if full else 0
        stop = full[dim] if stop is None else stop
        if sdim is None:  # replicated: any piece is the whole tensor
            whole = self._assemble(kind, name, pieces[0])
            return whole.narrow(dim, start, stop - start) if full else whole
        lo, hi = (start, stop) if sdim == dim else (0, full[sdim])
        parts = [(p.offset, self._assemble(kind, name, p)) for p in pieces
                 if p.offset < hi and p.offset + p.local[sdim] > lo]
        covered = sum(min(hi, o + t.shape[sdim]) - max(lo, o) for o, t in parts)
        if covered != hi - lo:
            raise ConfigError(f"{name}: the checkpoint's shards cover {covered} of rows {lo}..{hi} along dim "
                              f"{sdim}; is a shard file missing?")
        cut = [t.narrow(sdim, max(lo, o) - o, min(hi, o + t.shape[sdim]) - max(lo, o)) for o, t in parts]
        out = torch.cat(cut, dim=sdim) if len(cut) > 1 else cut[0]
        return out if sdim == dim else out.narrow(dim, start, stop - start)

    def full(self, kind: str = MASTER) -> dict[str, torch.Tensor]:
        """Every full parameter (e.g. for export); only rows and columns once."""
        return {name: self.read(kind, name) for name in self.shapes}


class RankTensors(dict):
    """The tensors of one shard file, read on lookup (``codec.decode`` asks only for the RNG's)."""

    def __init__(self, index: ShardIndex, path: str) -> None:
        super().__init__()
        self.index, self.path = index, path

    def __missing__(self, key: str) -> torch.Tensor:
        return self.index.get(self.path, key)


def set_local_params(engine: Engine, pstate: Any, params: dict[str, nn.Parameter], read: Read,
                     keys: list[str]) -> None:
    """Set each local parameter (its weight, fp32 master and the optimizer state tensors ``keys``) from
    ``read(kind, name, dim, start, stop)``, the slice of the full tensor this rank's piece is."""
    shapes = full_shapes(engine.module.config)
    for name, p in params.items():
        spec, offset = local_spec(p, shapes[name], pstate.tp_rank, pstate.tp_size, name)
        stop = None if spec.dim is None else offset + p.shape[spec.dim]
        values = {k: read(k, name, spec.dim, offset, stop) for k in (MASTER, *keys)}
        optimizer_state.set_param(engine, p, values)


def load_layout_free(engine: Engine, pstate: Any, tag_dir: str, optimizer: bool = True, counters: bool = True,
                     own: Any = None) -> dict[str, Any]:
    """Set this rank's weights, fp32 masters (``optimizer``: optimizer state, scheduler; ``counters``:
    the engine's step counters) from ``tag_dir``: ``own`` (``checkpoint.own_shard.load``) reads only the
    bytes this rank holds where it can, else every file's pieces are assembled. Returns the client
    state (iteration, consumed samples, plugins, rng: this rank's own at the saving layout)."""
    header, state_tensors = read_state(tag_dir)
    keys = optimizer_state.keys_to_load(header, optimizer)
    optimizer_state.prepare(engine, header, keys, optimizer)
    params = local_parameters(engine.module, engine.module.config.num_layers, pstate.pp_size > 1)
    rng = own(engine, pstate, tag_dir, header, params, keys) if own is not None else None
    if rng is None:
        rng = _load_assembled(engine, pstate, tag_dir, header, params, keys, state_tensors)
    if optimizer and header["scheduler"] is not None:
        engine.load_scheduler_state(header["scheduler"])
    if counters:
        engine.set_counters(header["engine"])
    return {"iteration": header["iteration"], "consumed_train_samples": header["consumed_train_samples"],
            "rng": rng, "plugins": codec.decode(header["plugins"], state_tensors)}


def _load_assembled(engine: Engine, pstate: Any, tag_dir: str, header: dict[str, Any],
                    params: dict[str, nn.Parameter], keys: list[str], state_tensors: Any) -> Any:
    """Every local parameter assembled from the fragments of every file that holds a part; the RNG."""
    index = ShardIndex(tag_dir)
    shapes = full_shapes(engine.module.config)
    if shapes != index.shapes:
        ours = {n: s for n, s in shapes.items() if index.shapes.get(n) != s}
        name = next(iter(ours), next(iter(set(index.shapes) - set(shapes)), "?"))
        raise ConfigError(f"--load {tag_dir}: parameter {name} is {index.shapes.get(name)} in the checkpoint "
                          f"but {shapes.get(name)} in this model; use the model flags it was saved with")
    set_local_params(engine, pstate, params, index.read, keys)
    own = index.rank_header(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank)
    layout = header["layout"]
    if own is not None and (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                            layout["data_parallel_size"]) == (pstate.tp_size, pstate.pp_size, pstate.dp_size):
        path = os.path.join(tag_dir, DIR, shard_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank))
        return codec.decode(own["rng"], RankTensors(index, path))
    return codec.decode(header["rng"], state_tensors)
