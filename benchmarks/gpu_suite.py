"""Everything issue 38's GPU run must show, each case in a fresh process, into one JSON and a table.

    python benchmarks/gpu_suite.py [--out gpu_suite.json] [--steps 10] [--budget-s 420] [--peak-tflops P]
    python benchmarks/gpu_suite.py --dry-run     # the same cases on CPU with tiny shapes (CI)

Cases (megapost's real Trainer and DeepSpeed engine, synthetic batches, DP=1, bf16): paper-180m eager,
``--compile`` and ``--compile`` with CUDA graphs (``mode="reduce-overhead"`` on each compiled block) at
the study's micro 4 x 8 and at the planner's recommended micro-batch (same global batch); per case
per-step times, tokens/s, MFU (Megatron's convention and the causal half), kernels per step and the
device-busy fraction (torch.profiler; on CPU the aten ops per step), peak memory vs the planner; the
Hugging Face ``LlamaForCausalLM`` peer at the same shape; Llama-1.3B- and 7B-width slices with and
without activation checkpointing; the collapse_metrics overhead at intervals 1 and 10; the real command
(examples/pretrain_postnorm.sh, plugin on at interval 10) against the benchmark at its flags; a
host-sync audit and the top kernels of one step; ``--async-save``. ``--budget-s`` stops starting cases
whose estimate would pass it; the finished rows are written after every case.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import torch
from case_runner import error_row, in_fresh_process, row_by_case, run_cases, write_json
from suite_cases import hf_peer, make_trainer, measure, real_command, sync
from suite_plan import PARTS, gpu_schedule, planned_micro
from toolchain import compile_toolchain_missing

from megapost.config.presets import LADDER_VOCAB, PRESETS


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


def overhead(interval: int, shape: tuple, o: argparse.Namespace) -> dict[str, Any]:
    """collapse_metrics at ``interval`` (its overhead over the eager row is added by the parent)."""
    from collapse_metrics.plugin import CollapseMetricsPlugin

    flags = ["--plugins", "collapse_metrics", "--collapse-interval", str(interval)]
    return measure(shape, flags, o, plugins=(CollapseMetricsPlugin,))


def _mean_s(trainer: Any, step: Any, o: argparse.Namespace, warmup: int | None = None) -> float:
    from suite_cases import step_times

    times = step_times(step, trainer.device, o.warmup if warmup is None else warmup, o.steps)
    return sum(times) / len(times)


def _save_and_step(trainer: Any, step: Any, o: argparse.Namespace, base: float) -> dict[str, Any]:
    """save() and the o.steps steps after it; the written fp32 masters against the bf16 weights the
    model held at the save (their rounding: a snapshot torn by the later steps would differ)."""
    from safetensors import safe_open

    from megapost.checkpoint.folder import tag_of
    from megapost.checkpoint.format import DIR, shard_file
    from megapost.checkpoint.specs import local_parameters

    device, cfg = trainer.device, trainer.engine.module.config
    params = local_parameters(trainer.engine.module, cfg.num_layers, False)
    at_save = {k: p.detach().clone() for k, p in params.items()}
    sync(device)
    t0 = time.perf_counter()
    trainer.save()
    blocked = time.perf_counter() - t0
    over = (_mean_s(trainer, step, o, 0) - base) * o.steps
    t1 = time.perf_counter()
    trainer.checkpoints.wait()
    tag = os.path.join(trainer.config.checkpoint.save, tag_of(trainer.state.iteration))
    exact = True
    with safe_open(os.path.join(tag, DIR, shard_file(0, 0, 0)), framework="pt") as f:
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
            trainer, _, _ = make_trainer(shape, flags)
            step = functools.partial(_next_step, trainer, iter(range(1, 10**9)))
            base = _mean_s(trainer, step, o)
            out[mode] = _save_and_step(trainer, step, o, base)
            trainer.close()
    sync_wall = out["sync"]["blocked_s"]
    out["lost_over_sync_wall"] = (out["async"]["blocked_s"] + out["async"]["overlapped_extra_s"]) / sync_wall
    return out


def _extra(r: dict[str, Any]) -> str:
    extra = []
    if r.get("kernels_per_step") is not None:
        extra.append(f"kernels/step {r['kernels_per_step']}, busy {100 * r['busy_fraction']:.0f}%")
    elif r.get("ops_per_step") is not None:
        extra.append(f"aten ops/step {r['ops_per_step']} (busy: GPU only)")
    if r.get("overhead") is not None:
        extra.append(f"overhead {100 * r['overhead']:+.1f}%")
    if r.get("auto_over_none") is not None:
        extra.append(f"auto/none tokens/s {r['auto_over_none']:.3f}")
    if r.get("triton_over_torch_paths") is not None:
        extra.append(f"Triton/torch paths tokens/s {r['triton_over_torch_paths']:.3f}")
    if r.get("head_chunked_over_unfused") is not None:
        extra.append(f"head peak bytes chunked/unfused {r['head_chunked_over_unfused']:.3f}")
    if r.get("triton_op") is not None:
        extra.append(_triton_line(r))
    if r.get("real_over_bench") is not None:
        extra.append(f"real/bench tokens/s {r['real_over_bench']:.3f}")
    if "host_syncs" in r:
        extra.append(f"host syncs {r['host_syncs']['counted']} (cuda warnings "
                     f"{r['host_syncs']['cuda_sync_warnings']})")
    return "; ".join(extra)


def _triton_line(r: dict[str, Any]) -> str:
    parts = [f"{x['path']} {x['us_per_call']:.0f} us, {x['kernels_per_call'] or x['ops_per_call']} "
             f"{'kernels' if x['kernels_per_call'] else 'ops'}" if "us_per_call" in x
             else f"{x['path']} {x.get('skipped') or x.get('error')}" for x in r["triton_op"]["rows"]]
    ratio = r.get("triton_over_replaced")
    return "; ".join(parts) + (f"; triton/replaced time {ratio:.3f}" if ratio is not None else "")


def _save_line(r: dict[str, Any]) -> str:
    sync, asy = r["sync"], r["async"]
    return (f"lost per save / sync save wall {r['lost_over_sync_wall']:.3f} (sync {sync['blocked_s']:.2f} s; "
            f"async blocks {asy['blocked_s']:.3f} s, overlapped steps +{asy['overlapped_extra_s']:.3f} s); "
            f"snapshot exact: {asy['snapshot_exact']}")


def _num(r: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    return format(r[key] * scale, fmt) if r.get(key) is not None else "n/a"


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"{'case':36s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>6s} {'causal':>6s} {'mem GB':>7s} "
           f"{'plan GB':>7s} extra"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            out.append(f"{r['case']:36s} {why}")
        elif "lost_over_sync_wall" in r:
            out.append(f"{r['case']:36s} {_save_line(r)}")
        else:
            out.append(f"{r['case']:36s} {_num(r, 's_per_step', '8.3f')} {_num(r, 'tokens_per_s', '10.0f')} "
                       f"{_num(r, 'mfu', '5.1f', 100):>6s} "
                       f"{_num(r, 'mfu_causal', '5.1f', 100):>6s} "
                       f"{_num(r, 'peak_mem_gb', '7.2f'):>7s} {_num(r, 'planned_gb', '7.2f'):>7s} "
                       f"{_extra(r)}")
    return "\n".join(out)


def graphed(shape: tuple, flags: list[str], o: argparse.Namespace) -> dict[str, Any]:
    """--compile with CUDA graphs: each compiled block with ``mode="reduce-overhead"`` (this process
    only: the case runs in its own interpreter)."""
    from megapost.parallel import compile as regional

    regional.torch.compile = functools.partial(torch.compile, mode="reduce-overhead")
    return measure(shape, flags, o)


def cases(o: argparse.Namespace) -> list[tuple[str, float, Any, str]]:
    """(name, estimated seconds on one H100/H200, fn() -> row or why it is skipped here, part): the
    must-show calls first, in the order of what issue 48 must show (benchmarks/suite_plan.py: the split
    and the estimates' reasons)."""
    paper = (TINY if o.dry_run else FULL)["paper-180m"]
    rec = o.recommended_micro or paper[6]
    at_rec = (*paper[:6], rec, paper[6] * paper[7] // rec, paper[8])
    no_compile = "dry run (compiling takes minutes on CPU)" if o.dry_run else compile_toolchain_missing()
    no_graphs = no_compile or (None if torch.cuda.is_available() else "CUDA graphs need CUDA")
    splits = {f"{paper[6]}x{paper[7]}": paper, f"{rec}x{at_rec[7]}": at_rec}  # one entry when they agree
    out: list[tuple[str, float, Any, str]] = [
        (f"paper-180m eager {m}", 45 if not i else 35, lambda s=s, a=not i: measure(s, [], o, audited=a), "1")
        for i, (m, s) in enumerate(splits.items())]
    out += [(f"collapse_metrics interval {i}", 40 if i == 1 else 35, lambda i=i: overhead(i, paper, o), "1")
            for i in (1, 10)]
    out.append((f"paper-180m --no-triton-kernels {paper[6]}x{paper[7]}", 35,
                lambda: measure(paper, ["--no-triton-kernels"], o), "1"))
    layers, hidden, ffn, heads, _, seq, micro, accum, _ = paper
    model = (["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
              "--num-attention-heads", str(heads), "--seq-length", str(seq)] if o.dry_run
             else ["--preset", "paper-180m"])
    real = [*model, "--micro-batch-size", str(micro), "--global-batch-size", str(micro * accum), "--bf16",
            "--train-iters", str(o.warmup + 3 * o.steps), "--log-interval", str(o.steps),
            "--eval-interval", "0",
            "--plugins", "collapse_metrics", "--collapse-interval", "10", "--run-name", "gpu-suite-real"]
    out.append(("real command (plugin interval 10)", 90, lambda: real_command(real, o, o.case_timeout), "1"))
    out += [(f"paper-180m graphs {m}", 100 if not i else 90, no_graphs or (
        lambda s=s: graphed(s, ["--compile"], o)), "2") for i, (m, s) in enumerate(splits.items())]
    out.append(("hf LlamaForCausalLM (peer)", 45, lambda: hf_peer(paper, o), "2"))
    return out + _extra_cases(o, paper, splits, no_compile)


def _extra_cases(o: argparse.Namespace, paper: tuple, splits: dict[str, tuple],
                 no_compile: str | None) -> list[tuple[str, float, Any, str]]:
    """The cases beyond the must-show (part "extra", on time left)."""
    first = next(iter(splits))
    out: list[tuple[str, float, Any, str]] = [
        (f"paper-180m --kernel-fusion none {first}", 35,
         lambda: measure(paper, ["--kernel-fusion", "none"], o)),
        ("head + loss memory, unfused vs chunked", 30, lambda: head_memory(o)),
        ("add + RMSNorm, triton vs torch", 20, lambda: triton_op("norm", o)),
        ("RoPE, triton vs torch ops", 20, lambda: triton_op("rope", o)),
        ("SwiGLU gate, triton vs torch ops", 20, lambda: triton_op("swiglu", o))]
    out += [(f"paper-180m --compile {m}", 90 if not i else 80, no_compile or (
        lambda s=s: measure(s, ["--compile"], o))) for i, (m, s) in enumerate(splits.items())]
    for width in ("1.3b-width", "7b-width"):
        for ckpt in ([], ["--checkpoint-activations"]):
            shape = (TINY if o.dry_run else FULL)[width]
            out.append((f"{width}{' ckpt' if ckpt else ''}", 20, lambda w=shape, c=ckpt: measure(w, c, o)))
    out.append(("async save (paper-180m shape)", 60, lambda: async_save(paper, o)))
    return [(name, est, fn, "extra") for name, est, fn in out]


def head_memory(o: argparse.Namespace) -> dict[str, Any]:
    """The paper's head + loss in bf16, unfused vs chunked (``--kernel-fusion`` ce): peak tensor bytes,
    each in a fresh process (benchmarks/head_memory.py; tiny in the dry run)."""
    import json
    import subprocess
    import tempfile

    shape = ["--tokens", "256", "--hidden", "64", "--vocab", "512"] if o.dry_run else []
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "head_memory.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "head.json")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        subprocess.run([sys.executable, script, "--dtypes", "bf16", "--device", device,
                        "--json", path, *shape], check=True, capture_output=True, timeout=o.case_timeout)
        with open(path) as f:
            rows = json.load(f)["rows"]
    unfused, chunked = (next(r for r in rows if r["case"] == c) for c in ("unfused", "chunked"))
    return {"head_memory": rows, "head_chunked_over_unfused": chunked["peak_tensor_bytes"]
            / unfused["peak_tensor_bytes"]}


def triton_op(op: str, o: argparse.Namespace) -> dict[str, Any]:
    """A Triton kernel against the path it replaces, forward + backward at the paper's shape, bf16, each
    path in a fresh process (benchmarks/triton_ops.py ``--op`` norm: one Post-Norm add + RMSNorm against
    the add + torch's fused RMSNorm; rope, swiglu: the packed q, k or the packed W_1/W_3 output against
    megapost's Function and the unfused expression; tiny, Triton in its CPU interpreter, in the dry run)."""
    import json
    import subprocess
    import tempfile

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_ops.py")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = {"norm": "2,64,96", "rope": "2,16,4,64", "swiglu": "2,16,192"}[op]
    shape = ["--shape", tiny, "--iters", "2", "--warmup", "1"] if o.dry_run else []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "op.json")
        subprocess.run([sys.executable, script, "--op", op, "--device", device, "--json", path, *shape],
                       check=True, capture_output=True, timeout=o.case_timeout)
        with open(path) as f:
            result = json.load(f)
    base = "torch" if op == "norm" else "function"  # the path Triton replaces on CUDA
    return {"triton_op": result, "triton_over_replaced": result.get(f"triton_over_{base}_time")}


def derive(rows: list[dict[str, Any]]) -> None:
    """Figures across rows: the plugin's overhead over eager 4 x 8, the real command over the benchmark,
    the fused kernels' speed-up (eager, i.e. --kernel-fusion auto, over none) and the Triton kernels'
    (eager over --no-triton-kernels)."""
    eager = next((r for r in rows if r["case"].startswith("paper-180m eager") and "s_per_step" in r), None)
    bench = row_by_case(rows, "collapse_metrics interval 10")
    for r in rows:
        if r["case"].startswith("paper-180m --kernel-fusion none") and eager and "tokens_per_s" in r:
            r["auto_over_none"] = eager["tokens_per_s"] / r["tokens_per_s"]
        if r["case"].startswith("paper-180m --no-triton-kernels") and eager and "tokens_per_s" in r:
            r["triton_over_torch_paths"] = eager["tokens_per_s"] / r["tokens_per_s"]
        if r["case"].startswith("collapse_metrics") and eager and "s_per_step" in r:
            r["overhead"] = r["s_per_step"] / eager["s_per_step"] - 1.0
        if r["case"].startswith("real command") and bench and "tokens_per_s" in r:
            r["real_over_bench"] = r["tokens_per_s"] / bench["tokens_per_s"]


CHILD = ("steps", "warmup", "peak_tflops", "recommended_micro")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, 2 timed steps (CI)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="one call's seconds: each must-show part's planned sum must fit it, and no case "
                   "starts whose estimate would pass it (default 300)")
    p.add_argument("--part", choices=(*PARTS, "all"), default=None,
                   help="which call (benchmarks/suite_plan.py; default 1, dry run all)")
    p.add_argument("--plan", action="store_true", help="print the planned schedule and stop (exit 1: a "
                   "must-show part's sum exceeds --budget-s)")
    p.add_argument("--out", default="gpu_suite.json")
    p.add_argument("--resume", action="store_true", help="keep the rows of a --out a died run left")
    p.add_argument("--inject-failure", metavar="CASE", help="make CASE raise (shows the suite goes on)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # the child: run this one case
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--recommended-micro", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--case-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.dry_run:
        o.steps, o.warmup, o.peak_tflops = 2, 1, o.peak_tflops or 1.0
    o.part = o.part or ("all" if o.dry_run else "1")
    if o.case:
        return child(o)
    begun = time.perf_counter()
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 141.0
    plan, fits = gpu_schedule(o, cases, FULL["paper-180m"], memory)  # the GPU's, in the dry run too
    print(plan)
    if o.plan or not fits:
        return 0 if fits else 1
    o.recommended_micro = planned_micro((TINY if o.dry_run else FULL)["paper-180m"], memory)
    todo = [c for c in cases(o) if o.part in ("all", c[3])]
    run_budget = 3600.0 if o.dry_run else o.budget_s  # the dry run's own wall on CPU
    estimate = {name: (1.0 if o.dry_run else est) for name, est, _, _ in todo}
    meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dry_run": o.dry_run, "shapes": FULL, "recommended_micro": o.recommended_micro,
            "budget_s": o.budget_s}
    base = [sys.executable, os.path.abspath(__file__), *(["--dry-run"] if o.dry_run else []),
            *(f"--{k.replace('_', '-')}={getattr(o, k)}" for k in CHILD)]

    def spawn(name: str, fn: Any) -> Any:
        def run(_rows: list) -> dict[str, Any]:
            if isinstance(fn, str):  # skipped here (no compiler, no CUDA): no process started
                return {"skipped": fn}
            left = run_budget - (time.perf_counter() - begun)
            return in_fresh_process([*base, "--case", name, f"--case-timeout={left:.0f}"], left)
        return run

    result = run_cases([(name, spawn(name, fn)) for name, _, fn, _ in todo], o.out, meta, resume=o.resume,
                       fail=o.inject_failure, budget_s=run_budget, estimate=estimate.__getitem__)
    derive(result["rows"])
    result["suite_wall_s"] = time.perf_counter() - begun
    write_json(o.out, result)
    print(table(result["rows"]))
    print(f"wrote {o.out}; the suite took {result['suite_wall_s']:.0f} s (budget {o.budget_s:.0f} s)")
    failed = [r["case"] for r in result["rows"] if "error" in r]
    if failed:
        print(f"{len(failed)} case(s) failed: {', '.join(failed)} (their rows hold the error)")


def child(o: argparse.Namespace) -> None:
    """One case in this interpreter; its row (or its error) into ``--row-out``."""
    import json
    import tempfile

    fn = next(fn for name, _, fn, _ in cases(o) if name == o.case)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-case-") as work:
        o.workdir = work
        try:
            row = fn()
        except Exception as e:  # noqa: BLE001  the parent records the error as the case's row
            row = error_row(e)
    with open(o.row_out, "w") as f:
        json.dump(row, f, default=str)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(main())
