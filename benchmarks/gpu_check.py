"""The first lent GPU hour, prepared: one command that confirms or refutes each risk of issue 27 on
the device, in < 10 minutes on one H200, into one JSON and a table.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--steps 10]
    python benchmarks/gpu_check.py --dry-run     # CPU smoke: the same checks at tiny shapes (CI)

Checks (megapost's real Trainer and DeepSpeed engine, synthetic batches, one process; the DP2 check
two):
  * bytes moved by collectives per optimizer step at 1, 4 and 8 micro-batches (bf16, ZeRO-2, overlap),
    counted by wrapping torch.distributed's collectives on this 1-rank world: grows with the
    micro-batches if gradients are reduced every micro-batch (issue 27 item 2); 0 if DP=1 skips them;
  * at DP2 (two GPUs; with one, skipped in one line; the CPU smoke runs it over gloo): the ring bytes
    per step at 1, 4 and 8 micro-batches with bf16 ``--overlap-grad-reduce`` beside the planner's
    figure (benchmarks/dp_bytes.py; equal within 5 % if reduced once per step as planned);
  * the non-finite skip: inf injected into one gradient; the weights must stay bit-for-bit unchanged;
  * the async save: which thread takes the snapshot and which CUDA device it is on (must be the
    rank's), whether the host buffer is pinned, its bytes beside the planner's figure;
  * MFU and GPU-busy fraction (kernel time / wall time of profiled steps), eager and --compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from typing import Any

import torch
from bench_common import build_trainer
from case_runner import run_cases
from collective_bytes import CollectiveBytes
from dp_bytes import dp_reduce_bytes, shape_flags, shape_ns
from gpu_suite import FULL, TINY
from suite_cases import measure
from toolchain import compile_toolchain_missing

from megapost.plan.memory import Layout, async_save_host_bytes

__all__ = ["CollectiveBytes", "main"]

_shape_ns, _flags = shape_ns, shape_flags


def reduce_bytes(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for accum in (1, 4, 8):
        trainer, _, _ = build_trainer(_shape_ns(shape, accum), _flags(shape, ["--zero-stage", "2",
                                                                            "--overlap-grad-reduce"]))
        trainer.train_step(1)
        with CollectiveBytes() as c:
            trainer.train_step(2)
        out[f"mib_per_step_accum{accum}"], out[f"calls_accum{accum}"] = c.bytes / 2**20, c.calls
        trainer = None
    one = out["mib_per_step_accum1"]
    out["ratio_8_over_1"] = out["mib_per_step_accum8"] / one if one else None
    out["verdict"] = ("no collective at DP=1 (run at DP>1 to see the per-micro-batch reduction)" if not one
                      else "reduced every micro-batch" if out["ratio_8_over_1"] > 1.5
                      else "reduced once per step")
    return out


def nonfinite_skip(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    trainer, _, _ = build_trainer(_shape_ns(shape), _flags(shape, []))
    trainer.train_step(1)
    params = [p for p in trainer.engine.module.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    hook = params[0].register_hook(lambda g: torch.full_like(g, float("inf")))
    trainer.train_step(2)
    hook.remove()
    unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
    return {"weights_unchanged": unchanged, "engine_skipped_steps": int(trainer.engine.ds.skipped_steps),
            "verdict": "skipped" if unchanged else "APPLIED a non-finite step (risk confirmed)"}


def async_save_touch(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    from megapost.checkpoint.snapshot import Snapshot

    seen: dict[str, Any] = {}
    real_take = Snapshot.take

    def take(self: Any) -> None:
        real_take(self)
        seen.update(thread=threading.current_thread().name, main=threading.current_thread() is
                    threading.main_thread(), device=torch.cuda.current_device() if self.device is not None
                    else None, pinned=all(b.is_pinned() for _, e, _ in self.files.files for _, b in e))

    with tempfile.TemporaryDirectory(prefix="gpu-check-save-") as d:
        trainer, cfg, _ = build_trainer(_shape_ns(shape), _flags(shape, ["--save", d, "--save-interval", "0",
                                                                         "--async-save"]))
        trainer.train_step(1)
        Snapshot.take = take
        try:
            trainer.save()
            trainer.train_step(2)
            trainer.checkpoints.wait()
        finally:
            Snapshot.take = real_take
        stage = trainer.engine.ds.zero_optimization_stage()
        layout = Layout(tp=1, pp=1, dp=1, zero_stage=stage, micro_batch=1, grad_accum=1)
        planned = async_save_host_bytes(cfg, layout)
    rank_device = trainer.device.index if trainer.device.type == "cuda" else None
    pool = trainer.checkpoints.saver.pool
    return {**seen, "rank_device": rank_device, "host_bytes": pool.nbytes, "planned_bytes": planned,
            "host_over_planned": pool.nbytes / planned,
            "verdict": "ok" if not seen.get("main") and seen.get("device") == rank_device else "CHECK"}


def mfu_busy(shape: tuple, o: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    if compiled and (o.dry_run or compile_toolchain_missing()):
        return {"skipped": "dry run" if o.dry_run else compile_toolchain_missing()}
    row = measure(shape, ["--compile"] if compiled else [], o)
    return {"mfu": row["mfu"], "tokens_per_s": row["tokens_per_s"], "s_per_step": row["s_per_step"],
            "gpu_busy": row["busy_fraction"], "kernels_per_step": row["kernels_per_step"]}


def table(rows: list[dict[str, Any]]) -> str:
    keys = ("verdict", "mib_per_step_accum1", "mib_per_step_accum4", "mib_per_step_accum8",
            *(f"{k}{m}" for m in (1, 4, 8) for k in ("mib_dp2_accum", "counted_over_planned_accum")),
            "weights_unchanged", "thread", "device", "rank_device", "pinned", "host_bytes",
            "host_over_planned", "mfu", "gpu_busy")
    out = []
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            out.append(f"{r['case']:28s} {why}")
            continue
        vals = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k in keys]
        out.append(f"{r['case']:28s} " + "  ".join(vals))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", "--cpu", action="store_true", help="tiny shapes on CPU (CI smoke)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--out", default="gpu_check.json")
    o = p.parse_args(argv)
    if o.dry_run:
        o.steps, o.warmup, o.peak_tflops = 1, 1, o.peak_tflops or 1.0
    shape = (TINY if o.dry_run else FULL)["paper-180m"]
    cases = [("reduce bytes vs micro-batches", lambda _r: reduce_bytes(shape, o)),
             ("DP2 reduce bytes vs planner", lambda _r: dp_reduce_bytes(shape, o)),
             ("non-finite skip", lambda _r: nonfinite_skip(shape, o)),
             ("async save thread/device", lambda _r: async_save_touch(shape, o)),
             ("MFU / busy eager", lambda _r: mfu_busy(shape, o, False)),
             ("MFU / busy compiled", lambda _r: mfu_busy(shape, o, True))]
    meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dry_run": o.dry_run}
    doc = run_cases(cases, o.out, meta)
    print(table(doc["rows"]))
    print(f"wrote {o.out}")
    return doc


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    main()
    sys.exit(0)
