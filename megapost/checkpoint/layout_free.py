"""megapost's layout-free checkpoint, written beside DeepSpeed's files inside every tag directory.

``<tag>/layout_free/`` holds safetensors files only (no pickle, nothing in them can run code):

* ``shard-tpTT-ppPP.safetensors``, one per (tensor rank, pipeline stage), written by its data-parallel
  rank 0: that rank's shard of every parameter it owns, under the single-process ``LlamaModel`` name,
  as fp32 master weights (``fp32/<name>``) and Adam moments (``exp_avg/<name>``, ``exp_avg_sq/<name>``),
  full over data parallelism. The header metadata ``megapost`` (JSON) gives, per name, the full shape,
  the split dimension (``null``: replicated, e.g. norm gains) and this shard's offset along it.
* ``state.safetensors``: the Adam step, scheduler, iteration, consumed samples, engine counters, RNG,
  plugin state (tensors inside it stored as tensors), the model config and the saving layout, in the
  header metadata ``megapost``; written by the logging (last) rank.
* ``manifest.json``: every file of the tag directory with its size, written last by rank 0, so a tag
  that lost a rank's files is refused before anything is read.

Loading at another layout (any TP, PP, DP, ZeRO stage, bf16 or sequence-parallel change) reads only
the slices this rank needs (``safe_open(...).get_slice``) and sets weights, fp32 masters and Adam state
through DeepSpeed's ``safe_set_full_*`` (ZeRO 1/2, bf16 optimizer) or the torch optimizer's state.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from megapost.config.errors import ConfigError
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


def _is_mapped(p: nn.Parameter) -> bool:
    """Held by a DeepSpeed mixed-precision/ZeRO optimizer (fp32 master in its flat partitions)."""
    return hasattr(p, "_hp_mapping")


def _full_over_dp(engine: Any, p: nn.Parameter, has_state: bool) -> dict[str, torch.Tensor]:
    """fp32 master and Adam moments of ``p`` (this TP rank's shard, full over DP). Collective over DP
    under ZeRO: every rank calls it for every parameter in the same order."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _is_mapped(p):
        out = {"fp32": safe_get_full_fp32_param(p)}
        if has_state:
            out.update({k: safe_get_full_optimizer_state(p, k) for k in MOMENTS})
    else:
        out = {"fp32": p.detach()}
        state = _base_optimizer(engine).state.get(p, {})
        if has_state:
            out.update({k: state[k] for k in MOMENTS})
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def _create_adam_state(engine: Any, step: int) -> None:
    """Adam state (zeros at ``step``) for every tensor the base optimizer steps, linked into DeepSpeed's
    per-parameter fragments so ``safe_set_full_optimizer_state`` can fill it."""
    base = _base_optimizer(engine)
    for group in base.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            device = p.device if on_device else torch.device("cpu")
            base.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=device),
                             **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS}}
    _link_state(engine)


def _link_state(engine: Any) -> None:
    """(Re)point DeepSpeed's per-parameter fragments at the base optimizer's current state tensors."""
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()


def _set_param(engine: Any, p: nn.Parameter, values: dict[str, torch.Tensor], has_state: bool) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    fp32 = values["fp32"].to(p.device)
    with torch.no_grad():
        p.data.copy_(fp32.to(p.dtype))
    if _is_mapped(p):
        safe_set_full_fp32_param(p, fp32)
        if has_state:
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, values[k].to(p.device), k)
    elif has_state:
        state = _base_optimizer(engine).state[p]
        for k in MOMENTS:
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


def layout_of(args: Any) -> dict[str, Any]:
    """What makes DeepSpeed's own files layout-specific (the effective ZeRO stage: bf16 runs use >= 1)."""
    zero = max(1, args.zero_stage) if args.bf16 else args.zero_stage
    return {"tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "data_parallel_size": args.data_parallel_size, "zero_stage": zero, "bf16": bool(args.bf16),
            "sequence_parallel": bool(args.sequence_parallel)}


def save_layout_free(engine: Any, pstate: Any, tag_dir: str, args: Any, client: dict[str, Any]) -> None:
    """Write ``tag_dir/layout_free/`` (collective: call on every rank, after DeepSpeed's save)."""
    cfg: ModelConfig = engine.module.config
    out = os.path.join(tag_dir, DIR)
    shapes = full_shapes(cfg)
    params = local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    step = _adam_step(engine)
    if step is not None:
        _link_state(engine)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for name, p in params.items():
        values = _full_over_dp(engine, p, step is not None)
        dim, offset = split_of(tuple(p.shape), shapes[name], pstate.tp_rank, pstate.tp_size, name)
        meta[name] = {"shape": list(shapes[name]), "dim": dim, "offset": offset}
        for kind, value in values.items():
            tensors[f"{kind}/{name}"] = value
    if pstate.dp_rank == 0:
        header = {"format": FORMAT, "tp_rank": pstate.tp_rank, "pp_rank": pstate.pp_rank, "params": meta}
        with atomic_path(os.path.join(out, shard_file(pstate.tp_rank, pstate.pp_rank))) as tmp:
            save_file(tensors, str(tmp), metadata={"megapost": json.dumps(header)})
    if pstate.is_logging_rank:
        state_tensors: dict[str, torch.Tensor] = {}
        scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        header = {
            "format": FORMAT, "iteration": client["iteration"],
            "consumed_train_samples": client["consumed_train_samples"], "adam_step": step,
            "scheduler": scheduler, "model_config": asdict(cfg), "layout": layout_of(args),
            "args": client.get("args", {}),
            "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps},
            "shards": [shard_file(t, p) for p in range(pstate.pp_size) for t in range(pstate.tp_size)],
            "rng": _encode(client["rng"], state_tensors, "rng"),
            "plugins": _encode(client["plugins"], state_tensors, "plugins"),
        }
        with atomic_path(os.path.join(out, STATE)) as tmp:
            save_file(state_tensors, str(tmp), metadata={"megapost": json.dumps(header)})
    if dist.is_initialized():
        dist.barrier()
    if pstate.global_rank == 0:
        write_manifest(tag_dir)


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


class ShardIndex:
    """Where each slice of each full parameter lives among the shard files of one tag."""

    def __init__(self, tag_dir: str) -> None:
        header, _ = read_state(tag_dir)
        self.header = header
        self.paths = [os.path.join(tag_dir, DIR, name) for name in header["shards"]]
        self.pieces: dict[str, list[tuple[str, int | None, int]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self.paths:
            with safe_open(path, framework="pt") as f:
                meta = json.loads(f.metadata()["megapost"])["params"]
            for name, m in meta.items():
                self.shapes[name] = tuple(m["shape"])
                self.pieces.setdefault(name, []).append((path, m["dim"], m["offset"]))

    def read(self, kind: str, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """``kind/name`` restricted to ``[start, stop)`` along ``dim`` (None: the full tensor)."""
        full = self.shapes[name]
        if dim is None:
            dim, start, stop = 0, 0, full[0] if full else 0
        stop = full[dim] if stop is None else stop
        parts = []
        seen: set[tuple[int, int]] = set()
        for path, sdim, offset in sorted(self.pieces[name], key=lambda x: x[2]):
            with safe_open(path, framework="pt") as f:
                sl = f.get_slice(f"{kind}/{name}")
                shape = tuple(sl.get_shape())
                if sdim is None:  # replicated: this file holds the whole tensor
                    index = [slice(None)] * len(full)
                    index[dim] = slice(start, stop)
                    return sl[tuple(index)] if full else sl[:]
                lo, hi = offset, offset + shape[sdim]
                if sdim != dim:  # another split axis than the one asked for: assemble whole, then cut
                    whole = self.read(kind, name, sdim, 0, full[sdim])
                    return whole.narrow(dim, start, stop - start)
                a, b = max(lo, start), min(hi, stop)
                if a >= b or (a, b) in seen:
                    continue
                seen.add((a, b))
                index = [slice(None)] * len(full)
                index[dim] = slice(a - lo, b - lo)
                parts.append((a, sl[tuple(index)]))
        out = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], dim=dim)
        if out.shape[dim] != stop - start:
            raise ConfigError(f"{name}: the checkpoint's shards cover {out.shape[dim]} of rows "
                              f"{start}..{stop} along dim {dim}; is a shard file missing?")
        return out

    def full(self, kind: str = "fp32") -> dict[str, torch.Tensor]:
        """Every full parameter (e.g. for export); only rows and columns once."""
        return {name: self.read(kind, name) for name in self.shapes}


# ----------------------------------------------------------------------------- load


def set_local_params(engine: Any, pstate: Any, params: dict[str, nn.Parameter], read: Any,
                     has_state: bool) -> None:
    """Set each local parameter (and its fp32 master and Adam moments when ``has_state``) from
    ``read(kind, name, dim, start, stop)``, which returns the slice of the full tensor this rank holds."""
    shapes = full_shapes(engine.module.config)
    for name, p in params.items():
        dim, offset = split_of(tuple(p.shape), shapes[name], pstate.tp_rank, pstate.tp_size, name)
        stop = None if dim is None else offset + p.shape[dim]
        kinds = ("fp32", *MOMENTS) if has_state else ("fp32",)
        _set_param(engine, p, {k: read(k, name, dim, offset, stop) for k in kinds}, has_state)


def load_layout_free(engine: Any, pstate: Any, tag_dir: str) -> dict[str, Any]:
    """Set this rank's weights, optimizer, scheduler, counters and RNG from ``tag_dir``'s layout-free
    state; returns the client state (iteration, consumed samples, plugins, rng)."""
    index = ShardIndex(tag_dir)
    header = index.header
    _, state_tensors = read_state(tag_dir)
    cfg: ModelConfig = engine.module.config
    shapes = full_shapes(cfg)
    if shapes != index.shapes:
        ours = {n: s for n, s in shapes.items() if index.shapes.get(n) != s}
        name = next(iter(ours), next(iter(set(index.shapes) - set(shapes)), "?"))
        raise ConfigError(f"--load {tag_dir}: parameter {name} is {index.shapes.get(name)} in the checkpoint "
                          f"but {shapes.get(name)} in this model; use the model flags it was saved with")
    step = header["adam_step"]
    if step is not None:
        _create_adam_state(engine, step)
    params = local_parameters(engine.module, cfg.num_layers, pstate.pp_size > 1)
    set_local_params(engine, pstate, params, index.read, has_state=step is not None)
    if header["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(header["scheduler"])
    counters = header["engine"]
    engine.global_steps, engine.global_samples = counters["global_steps"], counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    return {"iteration": header["iteration"], "consumed_train_samples": header["consumed_train_samples"],
            "rng": _decode(header["rng"], state_tensors),
            "plugins": _decode(header["plugins"], state_tensors)}
