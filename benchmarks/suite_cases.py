"""The measurements gpu_suite.py runs, one case per fresh process: megapost's step (per-step times,
tokens/s, MFU, kernels per step and the device-busy fraction, peak memory against the planner), the
collapse_metrics overhead (measured against quiet steps), the host-sync audit, the top kernels, the
Hugging Face ``LlamaForCausalLM`` peer at the same shape, and the real command (the example script) at
the benchmark's flags."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_common import build_trainer, synthetic_batches

from megapost.metrics.host_syncs import HostSyncCounter
from megapost.metrics.peak_flops import resolve_peak
from megapost.plan import planned_rank_peak
from megapost.utils.op_count import AtenOpCounter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_trainer(shape: tuple, flags: list[str], plugins: tuple = ()) -> tuple[Any, Any, argparse.Namespace]:
    layers, hidden, ffn, heads, groups, seq, micro, accum, vocab = shape
    b = argparse.Namespace(layers=layers, hidden=hidden, seq=seq, micro=micro, accum=accum, vocab=vocab)
    extra = ["--bf16", "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads), *flags]
    if groups:
        extra += ["--num-query-groups", str(groups)]
    return build_trainer(b, extra, plugins)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup``: CUDA events between steps (no sync inside
    the window), the wall clock on CPU."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for i in range(steps):
            step()
            marks[i + 1].record()
        sync(device)
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def kernels(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One step's kernel count and device-busy fraction (the union of kernel intervals over the step's
    wall time) from torch.profiler on CUDA; on CPU the aten compute ops dispatched (a kernel each on a
    GPU; views left out), busy being GPU-only."""
    if device.type != "cuda":
        with AtenOpCounter() as count:
            step()
        return {"ops_per_step": count.compute, "kernels_per_step": None, "busy_fraction": None}
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return {"kernels_per_step": len(spans), "busy_fraction": busy / wall_us if wall_us else None}


def rates(row: dict[str, Any], times: list[float], tokens: int, flops_per_token: float, causal: float,
          peak: Any) -> dict[str, Any]:
    s = statistics.mean(times)  # the mean: at --collapse-interval 10 one step in ten is measured
    tflops = tokens / s * flops_per_token / 1e12
    mfu = tflops / peak.tflops if peak.tflops > 0 else None
    return {**row, "step_times": times, "s_per_step": s, "tokens_per_s": tokens / s, "tflops": tflops,
            "peak_tflops": peak.tflops, "peak_source": peak.source, "mfu": mfu,
            "mfu_causal": mfu * causal if mfu else None}


def measure(shape: tuple, flags: list[str], o: argparse.Namespace, plugins: tuple = (),
            audited: bool = False) -> dict[str, Any]:
    """One case of megapost's Trainer: per-step times (median as s/step), tokens/s, MFU, kernels per step,
    busy fraction, peak memory vs the planner; with ``audited`` the host-sync audit and top kernels."""
    trainer, cfg, args = make_trainer(shape, flags, plugins)
    device, n = trainer.device, iter(range(1, 10**9))

    def step() -> None:  # the loop's step: the plugins' after_iteration reads a measured step's values
        i = next(n)
        trainer.train_step(i)
        trainer.host.after_iteration(i)

    times = step_times(step, device, o.warmup, o.steps)
    peak = resolve_peak(o.peak_tflops, torch.bfloat16, device)
    row = rates({"flags": flags, "params_m": cfg.num_parameters() / 1e6,
                 "micro_x_accum": [args.micro_batch_size, args.grad_accum_steps]}, times,
                args.global_batch_size * args.seq_length, cfg.flops_per_token(),
                cfg.flops_per_token(causal=True) / cfg.flops_per_token(), peak)
    if device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    ds_config = trainer.engine.ds._config._param_dict
    planned = planned_rank_peak(cfg, trainer.config.engine.batch, trainer.config.runtime, trainer.pstate,
                                ds_config)
    row["planned_gb"] = planned / 2**30
    if "peak_mem_gb" in row:
        row["mem_over_plan"] = row["peak_mem_gb"] / row["planned_gb"]
    row.update(kernels(step, device))
    if audited:
        row["host_syncs"] = audit(trainer, device)
        row["top_kernels"] = top_kernels(trainer, device)
    trainer.close()
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
        sync(device)
    self_key, total_key = (("self_device_time_total", "device_time_total") if device.type == "cuda"
                           else ("self_cpu_time_total", "cpu_time_total"))
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, self_key, 0.0), reverse=True)[:k]
    return [{"name": e.key[:80], "self_ms": getattr(e, self_key, 0.0) / 1e3,
             "total_ms": getattr(e, total_key, 0.0) / 1e3, "calls": e.count} for e in rows]


def hf_peer(shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    """Hugging Face ``LlamaForCausalLM`` at the same shape: fp32 weights, bf16 autocast, SDPA, AdamW
    (fused on CUDA), the same micro-batches and accumulation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, ffn, heads, groups, seq, micro, accum, vocab = shape
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=groups or heads,
                         max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = synthetic_batches(vocab, micro, seq)

    def step() -> None:
        for _ in range(accum):
            batch = next(batches)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(input_ids=batch["tokens"].to(device), labels=batch["labels"].to(device))
            (out.loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = step_times(step, device, o.warmup, o.steps)
    peak = resolve_peak(o.peak_tflops, torch.bfloat16, device)
    from megapost.model import ModelConfig

    cfg = ModelConfig(vocab_size=vocab, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                      num_attention_heads=heads, num_query_groups=groups, seq_length=seq)
    row = rates({"params_m": sum(p.numel() for p in model.parameters()) / 1e6}, times, micro * accum * seq,
                cfg.flops_per_token(), cfg.flops_per_token(causal=True) / cfg.flops_per_token(), peak)
    if device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    row.update(kernels(step, device))
    return row


TOKENS_S = re.compile(r"tokens/s (\d+)")


def real_command(argv: list[str], o: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """examples/pretrain_postnorm.sh (one process: what ``deepspeed`` runs on each rank) with ``argv``;
    its logged tokens/s after the first log line, as the median."""
    cmd = [sys.executable, os.path.join(REPO, "examples", "pretrain_postnorm.sh"), *argv]
    start = time.perf_counter()
    env = {**os.environ, "MEGAPOST_RUN_DIR": o.workdir}  # its run directory in the case's temporary one
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=o.workdir, env=env)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise RuntimeError(f"the real command exited {proc.returncode}: {tail}")
    logged = [int(m) for m in TOKENS_S.findall(proc.stdout)]
    if len(logged) < 2:
        raise RuntimeError(f"the real command logged {len(logged)} tokens/s lines")
    return {"command": " ".join(["examples/pretrain_postnorm.sh", *argv]), "logged_tokens_per_s": logged,
            "tokens_per_s": statistics.median(logged[1:]), "wall_s": time.perf_counter() - start}
