"""Reading megapost's checkpoint: ``<tag>/layout_free/``, safetensors files only (nothing in them can
run code), is the checkpoint (DeepSpeed's own files only with ``--ckpt-format deepspeed``).

* Format 2 (``checkpoint.sharded`` writes it): ``shard-tpTT-ppPP-dpDD.safetensors``, one per rank, the
  flat fragments of fp32 masters and optimizer state that rank owns, with full shape, TP split and
  fragment (start, numel) per name in the header metadata ``megapost``. Format 1 (older tags):
  ``shard-tpTT-ppPP.safetensors`` per (TP, PP) rank, full over data parallelism.
* ``state.safetensors``: the Adam step, scheduler, iteration, consumed samples, engine counters, RNG,
  plugin state, the model config and the saving layout; written by the logging (last) rank.
* ``manifest.json``: every file of the tag directory with its size, written last by rank 0, so a tag
  that lost a rank's files is refused before anything is read.

At another layout (TP, PP, DP, ZeRO stage, bf16, SP) a rank reassembles the pieces it needs and sets
weights, fp32 masters and optimizer state via ``safe_set_full_*`` or the torch optimizer's state; at
the saving layout it reads only its own file (``checkpoint.own_shard``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from megapost.config.errors import ConfigError
from megapost.ds_adapter import fragments
from megapost.model import LlamaModel, ModelConfig
from megapost.utils.atomic import atomic_path

DIR = "layout_free"
STATE = "state.safetensors"
MANIFEST = "manifest.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = 1


def shard_file(tp_rank: int, pp_rank: int) -> str:
    return f"shard-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The single-process model's parameter names and shapes (built on the meta device)."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def local_parameters(module: nn.Module, num_layers: int, pipeline: bool) -> dict[str, nn.Parameter]:
    """This rank's parameters under their ``LlamaModel`` names."""
    if not pipeline:
        return dict(module.named_parameters())
    from megapost.parallel.pipeline import model_parameter_name

    return {model_parameter_name(name, num_layers): p for name, p in module.named_parameters()}


def split_of(local: tuple[int, ...], full: tuple[int, ...], tp_rank: int, tp_size: int,
             name: str) -> tuple[int | None, int]:
    """(split dim or None, offset) of a local shard. A dimension holding ``full/local`` distinct
    contiguous pieces spread evenly over the TP ranks (``full/local == tp``: plain sharding; fewer:
    pieces replicated over adjacent ranks, as grouped K/V heads with fewer groups than TP ranks)."""
    if local == full:
        return None, 0
    dims = [d for d, (a, b) in enumerate(zip(local, full, strict=True)) if a != b]
    if len(dims) != 1 or full[dims[0]] % local[dims[0]]:
        raise ValueError(f"{name}: local shape {local} is not a shard of the full shape {full}")
    d = dims[0]
    pieces = full[d] // local[d]
    return d, (tp_rank * pieces // tp_size) * local[d]


# ----------------------------------------------------------------------------- optimizer access


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _adam_step(engine: Any) -> int | None:
    for state in _base_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return None


def state_keys(engine: Any) -> list[str]:
    """Every non-scalar tensor key of the optimizer's ``state[p]`` (Adam's moments, SGD's momentum)."""
    return sorted({k for st in _base_optimizer(engine).state.values() for k, v in st.items()
                   if torch.is_tensor(v) and v.dim() > 0})


_is_mapped = fragments.is_mapped


def _create_state(engine: Any, keys: list[str], step: int | None) -> None:
    """Optimizer state (zeros for ``keys``, ``step`` when the optimizer counts steps) for every tensor the
    base optimizer steps, linked into DeepSpeed's per-parameter fragments so
    ``safe_set_full_optimizer_state`` can fill it."""
    base = _base_optimizer(engine)
    for group in base.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            device = p.device if on_device else torch.device("cpu")
            counted = {} if step is None else {"step": torch.tensor(float(step), device=device)}
            base.state[p] = {**counted, **{k: torch.zeros_like(p, memory_format=torch.preserve_format)
                                           for k in keys}}
    _link_state(engine)


def _set_groups(engine: Any, saved: list[dict[str, Any]] | None) -> None:
    """The optimizer's group settings as saved (momentum, betas, ...; the lr is the scheduler's)."""
    groups = _base_optimizer(engine).param_groups
    if not saved or len(saved) != len(groups):
        return
    for group, settings in zip(groups, saved, strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()
                      if k in group and k not in ("lr", "initial_lr")})


def _link_state(engine: Any) -> None:
    """(Re)point DeepSpeed's per-parameter fragments at the base optimizer's current state tensors."""
    fragments.link_state(engine.optimizer)


def _set_param(engine: Any, p: nn.Parameter, values: dict[str, torch.Tensor], keys: list[str]) -> None:
    fp32 = values["fp32"].to(p.device)
    with torch.no_grad():
        p.data.copy_(fp32.to(p.dtype))
    if _is_mapped(p):
        fragments.set_full(p, fp32, {k: values[k].to(p.device) for k in keys})
    elif keys:
        state = _base_optimizer(engine).state[p]
        for k in keys:
            state[k].copy_(values[k])


# ----------------------------------------------------------------------------- JSON-safe state


def _encode(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """Nested state -> JSON, tensors moved into ``tensors`` (referenced by key)."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {str(k): _encode(v, tensors, f"{key}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return {"__seq__": [_encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return obj


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        if "__seq__" in obj:
            items = [_decode(v, tensors) for v in obj["__seq__"]]
            return tuple(items) if obj["tuple"] else items
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- save


def layout_of(*, tensor_model_parallel_size: int, pipeline_model_parallel_size: int, data_parallel_size: int,
              zero_stage: int, bf16: bool, sequence_parallel: bool) -> dict[str, Any]:
    """What makes DeepSpeed's own files layout-specific (the effective ZeRO stage: bf16 runs use >= 1)."""
    zero = max(1, zero_stage) if bf16 else zero_stage
    return {"tensor_model_parallel_size": tensor_model_parallel_size,
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
            "data_parallel_size": data_parallel_size, "zero_stage": zero, "bf16": bool(bf16),
            "sequence_parallel": bool(sequence_parallel)}


def write_manifest(tag_dir: str) -> None:
    """Every file under ``tag_dir`` (relative path -> size); written last."""
    files = {}
    for root, _, names in os.walk(tag_dir):
        for n in names:
            path = os.path.join(root, n)
            rel = os.path.relpath(path, tag_dir)
            if rel != os.path.join(DIR, MANIFEST) and not n.startswith("."):
                files[rel] = os.path.getsize(path)
    with atomic_path(os.path.join(tag_dir, DIR, MANIFEST)) as tmp, open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=0, sort_keys=True)


# ----------------------------------------------------------------------------- read


def check_complete(tag_dir: str, flag: str = "--load") -> bool:
    """False for a tag without a layout-free part (older checkpoints); raises ConfigError naming the
    missing files when a rank's files are gone or truncated."""
    path = os.path.join(tag_dir, DIR, MANIFEST)
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(tag_dir, DIR)):
            raise ConfigError(f"{flag} {tag_dir}: the checkpoint is incomplete ({DIR}/{MANIFEST} is missing: "
                              "the save did not finish); load an earlier tag (--iteration / 'latest')")
        return False
    with open(path) as f:
        files = json.load(f)["files"]
    paths = {rel: os.path.join(tag_dir, rel) for rel in files}
    bad = [rel for rel, size in sorted(files.items())
           if not os.path.isfile(paths[rel]) or os.path.getsize(paths[rel]) != size]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ConfigError(f"{flag} {tag_dir}: the checkpoint is incomplete: {len(bad)} of {len(files)} files "
                          f"missing or truncated ({shown}); copy every rank's files or load another tag")
    return True


def read_state(tag_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(header, tensors) of ``state.safetensors``."""
    with safe_open(os.path.join(tag_dir, DIR, STATE), framework="pt") as f:
        header = json.loads(f.metadata()["megapost"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return header, tensors


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
    file per (TP, PP) rank, full over DP; format 2: one per rank, its ZeRO fragments)."""

    def __init__(self, tag_dir: str) -> None:
        header, _ = read_state(tag_dir)
        self.header = header
        self.paths = [os.path.join(tag_dir, DIR, name) for name in header["shards"]]
        self.pieces: dict[str, dict[int, Piece]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._files: dict[str, Any] = {}
        for path in self.paths:
            head = json.loads(self._open(path).metadata()["megapost"])
            for name, m in head["params"].items():
                self.shapes[name] = tuple(m["shape"])
                local = tuple(m["local"]) if "local" in m else \
                    tuple(self._open(path).get_slice(f"fp32/{name}").get_shape())
                piece = self.pieces.setdefault(name, {}).setdefault(
                    m["offset"], Piece(m["dim"], m["offset"], local, head["tp_rank"]))
                if piece.tp_rank == head["tp_rank"]:  # a piece replicated over TP ranks: read one copy
                    numel = m.get("numel", math.prod(local))
                    piece.frags.append((path, m.get("start", 0), numel))

    def _open(self, path: str) -> Any:
        if path not in self._files:
            self._files[path] = safe_open(path, framework="pt")
        return self._files[path]

    def rank_header(self, tp_rank: int, pp_rank: int, dp_rank: int) -> dict[str, Any] | None:
        """The header of one rank's shard file (format 2), None when the tag has none for it."""
        path = os.path.join(os.path.dirname(self.paths[0]), shard_file_v2(tp_rank, pp_rank, dp_rank))
        return json.loads(self._open(path).metadata()["megapost"]) if path in self.paths else None

    def get(self, path: str, key: str) -> torch.Tensor:
        return self._open(path).get_tensor(key)

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

    def full(self, kind: str = "fp32") -> dict[str, torch.Tensor]:
        """Every full parameter (e.g. for export); only rows and columns once."""
        return {name: self.read(kind, name) for name in self.shapes}

# ----------------------------------------------------------------------------- load


def set_local_params(engine: Any, pstate: Any, params: dict[str, nn.Parameter], read: Any,
                     keys: list[str]) -> None:
    """Set each local parameter (its fp32 master, and the optimizer state tensors ``keys``) from
    ``read(kind, name, dim, start, stop)``, which returns the slice of the full tensor this rank holds."""
    shapes = full_shapes(engine.module.config)
    for name, p in params.items():
        dim, offset = split_of(tuple(p.shape), shapes[name], pstate.tp_rank, pstate.tp_size, name)
        stop = None if dim is None else offset + p.shape[dim]
        _set_param(engine, p, {k: read(k, name, dim, offset, stop) for k in ("fp32", *keys)}, keys)


def load_layout_free(engine: Any, pstate: Any, tag_dir: str, optimizer: bool = True, counters: bool = True,
                     own: Any = None) -> dict[str, Any]:
    """Set this rank's weights, fp32 masters (``optimizer``: optimizer state, scheduler; ``counters``:
    DeepSpeed's step counters) from ``tag_dir``: ``own`` (``checkpoint.own_shard.load``) reads only this
    rank's file at the saving layout, else every file's pieces are assembled. Returns the client state
    (iteration, consumed samples, plugins, rng: this rank's own at the saving layout)."""
    header, state_tensors = read_state(tag_dir)
    cfg: ModelConfig = engine.module.config
    step = header["adam_step"]
    keys = header.get("state_keys", list(MOMENTS) if step is not None else []) if optimizer else []
    if keys or (optimizer and step is not None):
        _create_state(engine, keys, step)
        _set_groups(engine, header.get("param_groups"))
    params = local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    rng = own(engine, pstate, tag_dir, header, params, keys) if own is not None else None
    if rng is None:
        rng = _load_assembled(engine, pstate, tag_dir, header, params, keys, state_tensors)
    if optimizer and header["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(header["scheduler"])
    if counters:
        saved = header["engine"]
        engine.global_steps, engine.global_samples = saved["global_steps"], saved["global_samples"]
        engine.skipped_steps = saved["skipped_steps"]
    return {"iteration": header["iteration"], "consumed_train_samples": header["consumed_train_samples"],
            "rng": rng, "plugins": _decode(header["plugins"], state_tensors)}


def _load_assembled(engine: Any, pstate: Any, tag_dir: str, header: dict[str, Any],
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
        path = os.path.join(tag_dir, DIR, shard_file_v2(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank))
        return _decode(own["rng"], _RankTensors(index, path))
    return _decode(header["rng"], state_tensors)


def shard_file_v2(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"shard-tp{tp_rank:02d}-pp{pp_rank:02d}-dp{dp_rank:02d}.safetensors"


class _RankTensors(dict):
    """The tensors of one shard file, read on lookup (``_decode`` asks only for the RNG's)."""

    def __init__(self, index: ShardIndex, path: str) -> None:
        super().__init__()
        self.index, self.path = index, path

    def __missing__(self, key: str) -> torch.Tensor:
        return self.index.get(self.path, key)
