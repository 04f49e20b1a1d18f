"""benchmarks/gpu_check.py's data-parallel bytes check: two ranks (two GPUs over NCCL, or on CPU two
processes over gloo for the smoke) each build megapost's real Trainer at 1, 4 and 8 micro-batches per
step, bf16 with ``--overlap-grad-reduce`` (the stage it resolves to: ZeRO-2 at one micro-batch, ZeRO-1
with megapost's overlapped once-per-step reduction otherwise), count the ring bytes of optimizer step 2
(``CollectiveBytes``) and set them beside the planner's data-parallel term for the same layout
(megapost.plan.search.comm_parts). With one GPU the check is skipped (one line)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megapost.utils.atomic import atomic_write_text

WORLD = 2
MICRO_BATCHES = (1, 4, 8)
TOLERANCE = 0.05  # counted / planned: the loss and norm all-reduces add a few bytes


def shape_ns(shape: tuple, accum: int | None = None) -> argparse.Namespace:
    layers, hidden, _, _, _, seq, micro, acc, vocab = shape
    return argparse.Namespace(layers=layers, hidden=hidden, seq=seq, micro=micro, accum=accum or acc,
                              vocab=vocab)


def shape_flags(shape: tuple, extra: list[str]) -> list[str]:
    _, _, ffn, heads, groups, *_ = shape
    return ["--bf16", "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
            *(["--num-query-groups", str(groups)] if groups else []), *extra]


def _count(shape: tuple) -> list[dict[str, Any]]:
    """On this rank: per micro-batch count, the counted and planned bytes of one optimizer step."""
    from bench_common import build_trainer
    from collective_bytes import CollectiveBytes

    from megapost.plan.memory import Layout
    from megapost.plan.search import comm_parts

    rows = []
    for accum in MICRO_BATCHES:
        trainer, cfg, _ = build_trainer(shape_ns(shape, accum), shape_flags(shape, ["--overlap-grad-reduce"]),
                                        world_size=WORLD)
        trainer.train_step(1)
        with CollectiveBytes() as c:
            trainer.train_step(2)
        stage = trainer.engine.ds.zero_optimization_stage()
        micro = shape[6]
        planned = comm_parts(cfg, Layout(1, 1, WORLD, stage, micro, accum), micro * accum * WORLD,
                             bf16=True)["dp"]
        rows.append({"micro_batches": accum, "zero_stage": stage, "wire": c.wire, "payload": c.bytes,
                     "calls": c.calls, "planned": planned})
        trainer.close()
    return rows


def _rank_main(rank: int, port: int, out: str, shape: tuple, bench_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    sys.path.insert(0, bench_dir)
    from collective_bytes import install

    install()  # before DeepSpeed's comm backend binds the collectives
    try:
        doc: dict[str, Any] = {"rows": _count(shape)}
    except Exception as e:  # noqa: BLE001 - reported as the check's error
        doc = {"error": f"{type(e).__name__}: {e}"}
    atomic_write_text(str(Path(out) / f"rank{rank}.json"), json.dumps(doc))


def dp_reduce_bytes(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    """The check's row: per micro-batch count, MiB counted and planned per rank per step, and a verdict."""
    import tempfile

    if not o.dry_run and torch.cuda.device_count() < WORLD:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s): DP{WORLD} needs {WORLD}"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gpu-check-dp-") as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, port, out, shape, str(Path(__file__).parent)))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.is_alive():
                p.kill()
        docs = [json.loads(f.read_text()) if f.exists() else {"error": "no result"}
                for f in (Path(out) / f"rank{r}.json" for r in range(WORLD))]
    errors = [d["error"] for d in docs if "error" in d]
    if errors:
        return {"error": "; ".join(errors)}
    row: dict[str, Any] = {"dp": WORLD}
    ok = True
    for r in docs[0]["rows"]:
        m, ratio = r["micro_batches"], r["wire"] / r["planned"]
        row[f"mib_dp2_accum{m}"] = r["wire"] / 2**20
        row[f"planned_mib_dp2_accum{m}"] = r["planned"] / 2**20
        row[f"zero_stage_accum{m}"] = r["zero_stage"]
        row[f"counted_over_planned_accum{m}"] = ratio
        ok = ok and abs(ratio - 1.0) <= TOLERANCE
    row["verdict"] = (f"counted = planned within {TOLERANCE:.0%}, once per step" if ok else
                      "CHECK: counted bytes differ from the planner's")
    return row
