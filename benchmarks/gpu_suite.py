"""Everything the first GPU hour should measure, in one process, into one JSON and a short table.

    python benchmarks/gpu_suite.py [--out gpu_suite.json] [--steps 20] [--peak-tflops P]
    python benchmarks/gpu_suite.py --dry-run     # the same cases on CPU with tiny shapes (CI)

Cases (megapost's real Trainer and DeepSpeed engine, synthetic batches, DP=1, bf16): paper-180m eager
and ``--compile`` (tokens/s, MFU in Megatron's convention and the causal half, peak memory vs the
planner), Llama-1.3B-width and 7B-width slices (few layers, seq 4096, GQA 8) with and without
activation checkpointing, the collapse_metrics overhead at intervals 1 and 10, a host-sync audit of
non-logging steps (``torch.cuda.set_sync_debug_mode`` on CUDA, ``HostSyncCounter`` everywhere), the
top kernels of one step (torch.profiler), the same model's bare-PyTorch step on the same device, and
``--async-save`` (time lost per save / a synchronous save; the background-written shard against the
weights at the save).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
import warnings
from typing import Any

import torch
from bench_common import build_trainer
from case_runner import row_by_case, run_cases
from toolchain import compile_toolchain_missing
from train_step import BareLoop

from megapost.config.presets import LADDER_VOCAB, PRESETS
from megapost.metrics.host_syncs import HostSyncCounter
from megapost.metrics.peak_flops import resolve_peak
from megapost.plan import planned_rank_peak


def preset_shape(preset: str, layers: int | None = None, seq: int | None = None, micro: int | None = None,
                 accum: int = 8, groups: int | None = None) -> tuple:
    """(layers, hidden, ffn, heads, query groups, seq, micro, accum, vocab): the preset's own width,
    FFN and heads; the slices below cut layers / pick seq, micro-batch and GQA."""
    p = PRESETS[preset]
    return (layers or p["num_layers"], p["hidden_size"], p["ffn_hidden_size"], p["num_attention_heads"],
            groups, seq or p["seq_length"], micro or p["micro_batch_size"], accum, LADDER_VOCAB)


FULL = {"paper-180m": preset_shape("paper-180m"),  # 48 x 512, d_ff 1536, 4 heads, seq 2048, mb 4 (x 8)
        "1.3b-width": preset_shape("llama-1.3b", layers=4, seq=4096, micro=1, accum=4, groups=8),
        "7b-width": preset_shape("llama-7b", layers=2, seq=4096, micro=1, accum=4, groups=8)}
TINY = {"paper-180m": (2, 64, 192, 4, None, 64, 2, 2, 512),
        "1.3b-width": (2, 64, 176, 8, 4, 128, 1, 2, 512),
        "7b-width": (1, 128, 344, 8, 4, 128, 1, 2, 512)}


def _trainer(shape: tuple, flags: list[str], plugins: tuple = ()) -> tuple[Any, Any, argparse.Namespace]:
    layers, hidden, ffn, heads, groups, seq, micro, accum, vocab = shape
    b = argparse.Namespace(layers=layers, hidden=hidden, seq=seq, micro=micro, accum=accum, vocab=vocab)
    extra = ["--bf16", "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads), *flags]
    if groups:
        extra += ["--num-query-groups", str(groups)]
    trainer, cfg, args = build_trainer(b, extra, plugins)
    return trainer, cfg, args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Any, device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def measure(name: str, shape: tuple, flags: list[str], o: argparse.Namespace, bare: bool = False,
            plugins: tuple = (), audited: bool = False) -> dict[str, Any]:
    """One case: seconds per step, tokens/s, MFU (Megatron / causal), peak memory vs the planner."""
    trainer, cfg, args = _trainer(shape, flags, plugins)
    device, n = trainer.device, iter(range(1, 10**9))
    step = trainer.train_step
    seconds = _time_steps(lambda: step(next(n)), device, o.warmup, o.steps)
    tokens = args.global_batch_size * args.seq_length
    peak = resolve_peak(o.peak_tflops, torch.bfloat16, device)
    row: dict[str, Any] = {"case": name, "flags": flags, "params_m": cfg.num_parameters() / 1e6,
                           "s_per_step": seconds, "tokens_per_s": tokens / seconds,
                           "peak_tflops": peak.tflops, "peak_source": peak.source}
    tflops = tokens / seconds * cfg.flops_per_token() / 1e12
    row["tflops"] = tflops
    row["mfu"] = tflops / peak.tflops if peak.tflops > 0 else None
    causal = cfg.flops_per_token(causal=True) / cfg.flops_per_token()
    row["mfu_causal"] = row["mfu"] * causal if row["mfu"] else None
    if device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    ds_config = trainer.engine.ds._config._param_dict
    planned = planned_rank_peak(cfg, trainer.config.data, trainer.config.runtime, trainer.pstate, ds_config)
    row["planned_gb"] = planned / 2**30
    if bare:
        loop = BareLoop(cfg, trainer.config.optimizer, "bf16", args.micro_batch_size, args.grad_accum_steps,
                        device)
        row["bare_s_per_step"] = _time_steps(loop.step, device, o.warmup, o.steps)
        row["megapost_over_bare"] = seconds / row["bare_s_per_step"]
    if audited:
        row["host_syncs"] = audit(trainer, device)
        row["top_kernels"] = top_kernels(trainer, device)
    trainer = step = None  # free the engine before the next case
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def audit(trainer: Any, device: torch.device) -> dict[str, Any]:
    """Host syncs over two non-logging steps: counted calls, and CUDA's own sync warnings."""
    with HostSyncCounter() as counter, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in (1001, 1002):
                trainer.train_step(step)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    cuda = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return {"counted": counter.total, "sites": dict(counter.sites), "cuda_sync_warnings": len(cuda),
            "cuda_examples": cuda[:5]}


def top_kernels(trainer: Any, device: torch.device, k: int = 8) -> list[dict[str, Any]]:
    """The ops of one step by their own (self) time: a parent op's inclusive time counts its children
    again and would list wrappers (``aten::linear``, autograd nodes) above the kernels that run."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        trainer.train_step(2001)
        _sync(device)
    self_key, total_key = (("self_device_time_total", "device_time_total") if device.type == "cuda"
                           else ("self_cpu_time_total", "cpu_time_total"))
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, self_key, 0.0), reverse=True)[:k]
    return [{"name": e.key[:80], "self_ms": getattr(e, self_key, 0.0) / 1e3,
             "total_ms": getattr(e, total_key, 0.0) / 1e3, "calls": e.count} for e in rows]


def overhead(interval: int, shape: tuple, o: argparse.Namespace, base: float | None) -> dict[str, Any]:
    """collapse_metrics at ``interval``; its overhead over the eager row (``base`` s/step, if it ran)."""
    from megapost.plugin_api import plugin_classes

    flags = ["--plugins", "collapse_metrics", "--collapse-interval", str(interval)]
    row = measure(f"collapse_metrics interval {interval}", shape, flags, o,
                  plugins=tuple(plugin_classes("collapse_metrics")))
    row["overhead"] = row["s_per_step"] / base - 1.0 if base else None
    return row


def _save_and_step(trainer: Any, step: Any, o: argparse.Namespace, base: float) -> dict[str, Any]:
    """save() and the o.steps steps after it; the written fp32 masters against the bf16 weights the
    model held at the save (their rounding: a snapshot torn by the later steps would differ)."""
    from safetensors import safe_open

    from megapost.checkpoint import layout_free as lf

    device, cfg = trainer.device, trainer.engine.module.config
    params = lf.local_parameters(trainer.engine.module, cfg.num_layers, False)
    at_save = {k: p.detach().clone() for k, p in params.items()}
    _sync(device)
    t0 = time.perf_counter()
    trainer.save()
    blocked = time.perf_counter() - t0
    over = (_time_steps(step, device, 0, o.steps) - base) * o.steps
    t1 = time.perf_counter()
    trainer.checkpoints.wait()
    tag = os.path.join(trainer.config.checkpoint.save, f"iter_{trainer.state.iteration:07d}")
    exact = True
    with safe_open(os.path.join(tag, lf.DIR, lf.shard_file_v2(0, 0, 0)), framework="pt") as f:
        for name, want in at_save.items():
            got = f.get_tensor(f"fp32/{name}").to(want.dtype).view(want.shape)
            exact &= torch.equal(got.to(want.device), want)
    return {"blocked_s": blocked, "overlapped_extra_s": max(0.0, over),
            "waited_after_steps_s": time.perf_counter() - t1, "snapshot_exact": exact}


def _next_step(trainer: Any, numbers: Any) -> Any:
    return trainer.train_step(next(numbers))


def async_save(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    """--async-save on this device: training time lost per save (save() blocking + how much the steps
    that overlap the background write slow down) / a synchronous save's wall time (the issue-18 ratio),
    and whether the shard written in the background is the state at the save."""
    import tempfile

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(prefix="gpu-suite-save-") as d:
            flags = ["--save", d, "--save-interval", "0", *(["--async-save"] if mode == "async" else [])]
            trainer, _, _ = _trainer(shape, flags)
            step = functools.partial(_next_step, trainer, iter(range(1, 10**9)))
            base = _time_steps(step, trainer.device, o.warmup, o.steps)
            out[mode] = _save_and_step(trainer, step, o, base)
            trainer = step = None
            gc.collect()
    sync_wall = out["sync"]["blocked_s"]
    out["lost_over_sync_wall"] = (out["async"]["blocked_s"] + out["async"]["overlapped_extra_s"]) / sync_wall
    return out


def _extra(r: dict[str, Any]) -> str:
    extra = []
    if "megapost_over_bare" in r:
        extra.append(f"megapost/bare {r['megapost_over_bare']:.3f}")
    if r.get("overhead") is not None:
        extra.append(f"overhead {100 * r['overhead']:+.1f}%")
    if "host_syncs" in r:
        extra.append(f"host syncs {r['host_syncs']['counted']} (cuda warnings "
                     f"{r['host_syncs']['cuda_sync_warnings']})")
    return "; ".join(extra)


def _save_line(r: dict[str, Any]) -> str:
    sync, asy = r["sync"], r["async"]
    return (f"lost per save / sync save wall {r['lost_over_sync_wall']:.3f} (sync {sync['blocked_s']:.2f} s; "
            f"async blocks {asy['blocked_s']:.3f} s, overlapped steps +{asy['overlapped_extra_s']:.3f} s); "
            f"snapshot exact: {asy['snapshot_exact']}")


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"{'case':34s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>6s} {'causal':>6s} {'mem GB':>7s} "
           f"{'plan GB':>7s} extra"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            out.append(f"{r['case']:34s} {why}")
            continue
        if "lost_over_sync_wall" in r:
            out.append(f"{r['case']:34s} {_save_line(r)}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        causal = f"{100 * r['mfu_causal']:.1f}%" if r.get("mfu_causal") else "n/a"
        mem = f"{r['peak_mem_gb']:.2f}" if "peak_mem_gb" in r else "n/a"
        out.append(f"{r['case']:34s} {r['s_per_step']:8.3f} {r['tokens_per_s']:10.0f} {mfu:>6s} {causal:>6s} "
                   f"{mem:>7s} {r['planned_gb']:7.2f} {_extra(r)}")
    return "\n".join(out)


def cases(o: argparse.Namespace) -> list[tuple[str, Any]]:
    """The suite's cases in order, each a thunk (run_cases runs them one at a time)."""
    shapes = TINY if o.dry_run else FULL
    eager = "paper-180m eager"

    def compiled(_rows: list) -> dict[str, Any]:
        if o.dry_run:
            return {"skipped": "dry run (compiling takes minutes on CPU)"}
        missing = compile_toolchain_missing()
        if missing:
            print(f"note: {missing}", flush=True)
            return {"skipped": missing}
        return measure("paper-180m --compile", shapes["paper-180m"], ["--compile"], o)

    out = [(eager, lambda _rows: measure(eager, shapes["paper-180m"], [], o, bare=True, audited=True)),
           ("paper-180m --compile", compiled)]
    for width in ("1.3b-width", "7b-width"):
        for ckpt in ([], ["--checkpoint-activations"]):
            name = f"{width}{' ckpt' if ckpt else ''}"
            out.append((name, lambda _rows, n=name, w=shapes[width], c=ckpt: measure(n, w, c, o)))
    for interval in (1, 10):
        out.append((f"collapse_metrics interval {interval}",
                    lambda rows, i=interval: overhead(i, shapes["paper-180m"], o,
                                                      (row_by_case(rows, eager) or {}).get("s_per_step"))))
    out.append(("async save (paper-180m shape)", lambda _rows: async_save(shapes["paper-180m"], o)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, 1 timed step (CI)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--out", default="gpu_suite.json")
    p.add_argument("--resume", action="store_true", help="keep the rows of a --out a died run left")
    p.add_argument("--inject-failure", metavar="CASE", help="make CASE raise (shows the suite goes on)")
    o = p.parse_args()
    if o.dry_run:
        o.steps, o.warmup, o.peak_tflops = 1, 1, o.peak_tflops or 1.0
    todo = cases(o)
    meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dry_run": o.dry_run, "shapes": FULL}
    result = run_cases(todo, o.out, meta, resume=o.resume, fail=o.inject_failure)
    print(table(result["rows"]))
    print(f"wrote {o.out}")
    failed = [r["case"] for r in result["rows"] if "error" in r]
    if failed:
        print(f"{len(failed)} case(s) failed: {', '.join(failed)} (their rows hold the error)")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(main())
