"""Rank bodies for the checkpoint fault tests (``run_ranks`` spawns them): a background write that fails
on one rank, a ``--save`` each rank sees differently, and a rollback during training."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any


def failing_write(argv: list[str], rank_to_fail: int, tag: str) -> dict[str, Any]:
    """Train with ``argv``; on ``rank_to_fail`` opening any file of ``tag`` fails as on a read-only
    filesystem (the OS error the writer sees). Returns the one-line error and the iteration it came at."""
    import builtins

    import torch.distributed as dist

    from megapost.checkpoint import stream_write
    from megapost.pretrain import run
    from megapost.runtime import interrupts

    def refuse(path: Any) -> None:
        if dist.get_rank() == rank_to_fail and tag in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def read_only_open(path: Any, *args: Any, **kw: Any) -> Any:
        refuse(path)
        return builtins.open(path, *args, **kw)

    class ReadOnlyDirect(stream_write._DirectFile):  # the background writer's O_DIRECT file
        def __init__(self, path: str, staging: Any) -> None:
            refuse(path)
            super().__init__(path, staging)

    # the writer's two ways to open a file (buffered; O_DIRECT where the filesystem takes it), this rank only
    stream_write.open = read_only_open  # type: ignore[attr-defined]
    stream_write._DirectFile = ReadOnlyDirect  # type: ignore[misc]
    try:
        run(argv)
    except SystemExit as e:
        return {"message": str(e.code), "iteration": interrupts.PROGRESS.state.iteration}
    return {"message": None, "iteration": interrupts.PROGRESS.state.iteration}


def shared_check(base: str) -> list[str | None]:
    """``check_shared`` on a directory all ranks see, then on one per rank (a node-local path)."""
    import torch.distributed as dist

    from megapost.checkpoint import saver

    out: list[str | None] = []
    for d in (os.path.join(base, "shared"), os.path.join(base, f"node{dist.get_rank()}")):
        try:
            saver.AsyncSaver().check_shared(d, dist.get_rank())
            out.append(None)
        except SystemExit as e:
            out.append(str(e.code))
    return out


def rollback(argv: list[str], snap_at: int, back_at: int, ckpt: str) -> dict[int, list[str]]:
    """Train with ``argv``; after iteration ``snap_at`` take an in-memory snapshot, after ``back_at`` roll
    back to it (as the collapse guard does). Returns the tags in ``ckpt`` after each iteration past the
    rollback, keyed by iteration."""
    from megapost.pretrain import run
    from megapost.train.plugin_host import PluginHost

    real, seen, state = PluginHost.after_iteration, {}, {"snap": None, "back": False}

    def after(self: PluginHost, iteration: int) -> Any:
        if state["back"]:
            seen[iteration] = sorted(p.name for p in Path(ckpt).iterdir() if p.name.startswith("iter_"))
        if iteration == snap_at and not state["back"]:
            state["snap"] = self.binding.snapshot()
        elif iteration == back_at and not state["back"]:
            state["back"] = True
            self.binding.restore(state["snap"], False)
        return real(self, iteration)

    PluginHost.after_iteration = after  # type: ignore[method-assign]
    run(argv)
    return seen


def poisoned_moment(argv: list[str]) -> str | None:
    """Train with ``argv``; just before the first save, one Adam moment value becomes NaN (the module's
    weights stay finite). Returns the error the save raised (None: it saved)."""
    from megapost.pretrain import run
    from megapost.train.checkpoints import CheckpointManager

    real = CheckpointManager.save

    def save(self: CheckpointManager) -> None:
        ds = self.engine.ds  # DeepSpeed's engine (a test reaches into it)
        base = getattr(ds.optimizer, "optimizer", ds.optimizer)
        state = next(iter(base.state.values()))
        state["exp_avg"].view(-1)[0] = float("nan")
        real(self)

    CheckpointManager.save = save  # type: ignore[method-assign]
    try:
        run(argv)
    except FloatingPointError as e:
        return str(e)
    except SystemExit as e:  # --async-save: the writer's refusal, raised at the next step boundary
        return str(e.code)
    return None


def train(argv: list[str]) -> None:
    from megapost.pretrain import run

    run(argv)


def _count(read: dict[str, int], path: str, t: Any) -> Any:
    read[path] += t.numel() * t.element_size()
    return t


def resume_reads(argv: list[str], assembled: bool) -> dict[str, Any]:
    """Resume with ``argv`` counting the tensor bytes this rank reads from each checkpoint file, whole
    tensors and slices (``assembled``: as if no fragment reader applied — every rank assembles from every
    file). Returns {"read": {file: bytes}, "own": the loaded tag's shard file of this rank's number,
    "need": this rank's shard file of the tag the run saves (its partition at the resumed layout)}."""
    from collections import defaultdict

    import torch.distributed as dist
    from safetensors import safe_open

    from megapost.checkpoint import format, own_shard, reader
    from megapost.pretrain import run

    read: dict[str, int] = defaultdict(int)

    class Counted:
        def __init__(self, path: str, framework: str) -> None:
            self.path, self.f = os.path.basename(path), safe_open(path, framework=framework)

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def get_tensor(self, key: str) -> Any:
            return _count(read, self.path, self.f.get_tensor(key))

        def get_slice(self, key: str) -> Any:
            part, path = self.f.get_slice(key), self.path

            class Sliced:
                def __getitem__(self, index: Any) -> Any:
                    return _count(read, path, part[index])

                def get_shape(self) -> Any:
                    return part.get_shape()
            return Sliced()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    reader.safe_open = Counted  # type: ignore[assignment]
    format.safe_open = Counted  # type: ignore[assignment]
    own_shard.safe_open = Counted  # type: ignore[assignment]
    if assembled:
        own_shard.load = lambda *a, **k: None  # type: ignore[assignment]
    run(argv)
    name = f"shard-tp00-pp00-dp{dist.get_rank():02d}.safetensors"  # TP 1, PP 1: DP rank = global rank
    load, save = (Path(argv[argv.index(flag) + 1]) for flag in ("--load", "--save"))
    own = load / (load / "latest").read_text().strip() / "layout_free" / name
    need = save / (save / "latest").read_text().strip() / "layout_free" / name
    return {"read": dict(read), "own": own.stat().st_size, "need": need.stat().st_size}


KINDS = ("fp32", "exp_avg", "exp_avg_sq")  # the tensors a format-2 shard holds per parameter


def full_tensors(tag: Path) -> dict[str, Any]:
    """Every full fp32 master and Adam moment of a format-2 tag, reassembled here from the shard files'
    own headers (local shape, fragment start/numel, TP split dim/offset), independently of megapost's
    reader; an element no shard holds stays NaN."""
    import json
    import math

    import torch
    from safetensors import safe_open

    locals_: dict[tuple[str, int], tuple[dict, torch.Tensor]] = {}
    for path in sorted((tag / "layout_free").glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            head = json.loads(f.metadata()["megapost"])
            for name, m in head["params"].items():
                for kind in KINDS:
                    key = (f"{kind}/{name}", m["offset"])
                    _, flat = locals_.setdefault(key, (m, torch.full((math.prod(m["local"]),), math.nan)))
                    flat[m["start"]:m["start"] + m["numel"]] = f.get_tensor(f"{kind}/{name}")
    full: dict[str, torch.Tensor] = {}
    for (key, offset), (m, flat) in locals_.items():
        out = full.setdefault(key, torch.full(m["shape"], math.nan))
        piece = flat.view(m["local"])
        if m["dim"] is None:
            out.copy_(piece)
        else:
            out.narrow(m["dim"], offset, piece.shape[m["dim"]]).copy_(piece)
    return full
