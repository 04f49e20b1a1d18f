"""The Triton kernels against the paths they replace, forward + backward at the paper's shapes (bf16),
each path in a fresh process. ``--op norm``: the residual add + RMSNorm of one Post-Norm sublayer
(micro-batch 4 x seq 2048 x width 512): "torch" (the add, then megapost's RMSNorm unfused: torch's fused
kernel, or apex's, on CUDA; ``--kernel-fusion none``), "triton" (``--kernel-fusion norm`` on CUDA) and,
on CPU, "function" (the autograd Function replacing torch's composite). ``--op rope``: RoPE of the packed
q and k (4 x 2048 x (4 + 4) heads x 128, a view of the Q/K/V GEMM's output): "torch" (the unfused
expression), "function" (``megapost.kernels.rope``, the default before Triton) and "triton". ``--op
swiglu``: the SwiGLU gate on the packed W_1/W_3 output (4 x 2048 x 2 * 1536): "torch" (``F.silu(h1) *
h3``), "function" (``megapost.kernels.swiglu_packed``) and "triton". Per path:
microseconds per forward + backward (after warm-up; host launch cost included: the paper's shape is
launch-bound), kernels per call (torch.profiler on CUDA; aten compute ops on CPU), and the largest error
of each output against the unfused path computed in fp32 (relative to the largest magnitude).

    python benchmarks/triton_ops.py [--op norm|rope|swiglu] [--shape ...] [--dtype bf16] [--paths ...]
        [--iters 100] [--device cuda|cpu] [--json OUT]

On CPU the "triton" path runs in Triton's interpreter (``TRITON_INTERPRET=1`` in its process): a check
that the path runs, its time means nothing (and its bf16 error is the interpreter's: it truncates fp32
to bf16). A path that cannot run here is a row with ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES = {"norm": "4,2048,512", "rope": "4,2048,8,128", "swiglu": "4,2048,3072"}
PATHS = {"norm": "torch,triton", "rope": "torch,function,triton", "swiglu": "torch,function,triton"}


def _rel(got: list[Any], want: list[Any], names: tuple[str, ...]) -> dict[str, float]:
    return {name: ((a.float() - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(names, got, want, strict=True)}


def _norm_case(path: str, shape: list[int], device: Any, dtype: Any, gen: Any) -> tuple[Any, Any]:
    """(step() -> [out, dx, dh, dg], fp32 reference of the same) for the add + RMSNorm."""
    import torch
    import torch.nn.functional as F

    from megapost.model.fusion import parse_fusion
    from megapost.model.norm import RMSNorm

    x, h, go = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    x.requires_grad_(), h.requires_grad_()
    norm = RMSNorm(shape[-1]).to(device, dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(shape[-1], generator=gen).to(device, dtype))
    norm.fusion = parse_fusion("none" if path == "torch" else "norm")

    def step() -> list[Any]:
        x.grad = h.grad = norm.weight.grad = None
        _, out = norm(x, h)
        out.backward(go)
        return [out.detach(), x.grad, h.grad, norm.weight.grad]

    def reference() -> list[Any]:
        xs, hs, ws = (t.detach().float().requires_grad_() for t in (x, h, norm.weight))
        out = F.rms_norm(xs + hs, [xs.shape[-1]], ws, norm.eps)
        out.backward(go.float())
        return [out.detach(), xs.grad, hs.grad, ws.grad]

    return step, reference


def _rope_case(path: str, shape: list[int], device: Any, dtype: Any, gen: Any) -> tuple[Any, Any]:
    """(step() -> [y, dx], fp32 reference) for RoPE of the packed q, k ([b, s, heads, d]: a view of
    a tensor with half as many heads again, as the Q/K/V GEMM's output holds v after them)."""
    import torch

    from megapost.kernels import rope, triton_rope
    from megapost.model.rope import apply_rope_tables, rope_cache, rope_tables

    b, s, heads, dim = shape
    qkv = torch.randn(b, s, heads + heads // 2, dim, generator=gen).to(device, dtype)
    x = qkv[:, :, :heads].requires_grad_()  # a strided view, as the packed q and k are
    cos, sin = rope_cache(s, dim, 10000.0, device)
    cos, ssin = (t.unsqueeze(1) for t in rope_tables(cos, sin, dtype))
    go = torch.randn(x.shape, generator=gen).to(device, dtype)
    fn = {"torch": apply_rope_tables, "function": rope, "triton": triton_rope}[path]

    def step() -> list[Any]:
        x.grad = None
        y = fn(x, cos, ssin)
        y.backward(go)
        return [y.detach(), x.grad]

    def reference() -> list[Any]:
        xs = x.detach().float().requires_grad_()
        y = apply_rope_tables(xs, cos.float(), ssin.float())
        y.backward(go.float())
        return [y.detach(), xs.grad]

    return step, reference


def _swiglu_case(path: str, shape: list[int], device: Any, dtype: Any, gen: Any) -> tuple[Any, Any]:
    """(step() -> [y, dh13], fp32 reference) for the SwiGLU gate on h13 [b, s, 2f]."""
    import torch
    import torch.nn.functional as F

    from megapost.kernels import swiglu_packed, triton_swiglu

    def unfused(h13: Any) -> Any:
        h1, h3 = h13.chunk(2, dim=-1)
        return F.silu(h1) * h3

    h13 = (2 * torch.randn(*shape, generator=gen)).to(device, dtype).requires_grad_()
    go = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(device, dtype)
    fn = {"torch": unfused, "function": swiglu_packed, "triton": triton_swiglu}[path]

    def step() -> list[Any]:
        h13.grad = None
        y = fn(h13)
        y.backward(go)
        return [y.detach(), h13.grad]

    def reference() -> list[Any]:
        hs = h13.detach().float().requires_grad_()
        y = unfused(hs)
        y.backward(go.float())
        return [y.detach(), hs.grad]

    return step, reference


CASES = {"norm": (_norm_case, ("out", "dx", "dh", "dg")), "rope": (_rope_case, ("y", "dx")),
         "swiglu": (_swiglu_case, ("y", "dh13"))}


def one_path(path: str, o: argparse.Namespace) -> dict[str, Any]:
    """Run ``path`` of ``o.op`` in this process (module docstring)."""
    import torch
    from suite_cases import kernels, sync

    from megapost.kernels import norm_path, rope_path, swiglu_path

    device = torch.device(o.device)
    chosen = {"norm": norm_path, "rope": rope_path, "swiglu": swiglu_path}[o.op](device)
    if path == "triton" and chosen != "triton" or path == "function" and o.op == "norm" and chosen != path:
        return {"path": path, "skipped": f"{path} does not run on {device.type} here ({o.op}: {chosen})"}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[o.dtype]
    case, names = CASES[o.op]
    step, reference = case(path, [int(s) for s in o.shape.split(",")], device, dtype,
                           torch.Generator().manual_seed(0))
    errors = _rel(step(), reference(), names)
    for _ in range(o.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(o.iters):
        step()
    sync(device)
    us = (time.perf_counter() - start) / o.iters * 1e6
    counted = kernels(step, device)
    return {"path": path, "us_per_call": us, "kernels_per_call": counted["kernels_per_step"],
            "ops_per_call": counted.get("ops_per_step"), "max_rel_error": errors}


def run(o: argparse.Namespace) -> dict[str, Any]:
    """Every path of ``o.paths`` in its own process; the result with the triton / torch time ratio."""
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    for path in o.paths.split(","):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        if path == "triton" and o.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--op", o.op, "--path", path, "--shape", o.shape,
               "--dtype", o.dtype, "--iters", str(o.iters), "--warmup", str(o.warmup), "--device", o.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=o.timeout, env=env)
        if proc.returncode:
            rows.append({"path": path, "error": proc.stderr.strip().splitlines()[-1][:300]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {"op": o.op, "shape": o.shape, "dtype": o.dtype, "device": o.device,
                              "rows": rows}
    by = {r["path"]: r for r in rows if "us_per_call" in r}
    for base in ("torch", "function"):
        if base in by and "triton" in by:
            result[f"triton_over_{base}_time"] = by["triton"]["us_per_call"] / by[base]["us_per_call"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=tuple(SHAPES), default="norm")
    p.add_argument("--shape", help="norm: b,s,width (4,2048,512); rope: b,s,q+k heads,head dim "
                                   "(4,2048,8,128); swiglu: b,s,2 ffn (4,2048,3072)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--paths", help="norm: torch,triton; rope, swiglu: torch,function,triton (the defaults)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--path", help=argparse.SUPPRESS)  # the child: one path in this process
    o = p.parse_args()
    o.shape, o.paths = o.shape or SHAPES[o.op], o.paths or PATHS[o.op]
    if o.path:
        print(json.dumps(one_path(o.path, o)))
        return
    result = run(o)
    for r in result["rows"]:
        if "us_per_call" in r:
            count = r["kernels_per_call"] if r["kernels_per_call"] is not None else f"{r['ops_per_call']} ops"
            err = ", ".join(f"{k} {v:.1e}" for k, v in r["max_rel_error"].items())
            print(f"{r['path']:8s} {r['us_per_call']:10.1f} us/call, kernels/call {count}; "
                  f"error vs fp32: {err}")
        else:
            print(f"{r['path']:8s} {r.get('skipped') or r.get('error')}")
    for base in ("torch", "function"):
        if f"triton_over_{base}_time" in result:
            print(f"triton / {base} time per call: {result[f'triton_over_{base}_time']:.3f}")
    if o.json:
        Path(o.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
