"""The residual add + RMSNorm of one Post-Norm sublayer, forward + backward, at the paper's layer shape
(micro-batch 4 x seq 2048 x width 512, bf16), each path in a fresh process: "torch" (the add, then
megapost's RMSNorm unfused: torch's fused kernel, or apex's, on CUDA; ``--kernel-fusion none``) against
"triton" (``--kernel-fusion norm`` on CUDA: one Triton kernel each way, ``megapost/kernels/triton_norm.py``)
and, on CPU, "function" (the autograd Function replacing torch's composite). Per path: microseconds per
forward + backward (after warm-up; host launch cost included: the paper's shape is launch-bound),
kernels per call (torch.profiler on CUDA; aten compute ops on CPU), and the largest error of the output
and each gradient against the unfused path computed in fp32 (relative to the largest magnitude).

    python benchmarks/norm_kernel.py [--shape 4,2048,512] [--dtype bf16] [--paths torch,triton]
        [--iters 100] [--device cuda|cpu] [--json OUT]

On CPU the "triton" path runs in Triton's interpreter (``TRITON_INTERPRET=1`` in its process): a check
that the path runs, its time means nothing. A path that cannot run here is a row with ``skipped``.
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

SPECS = {"torch": "none", "triton": "norm", "function": "norm"}


def _errors(norm: Any, x: Any, h: Any, go: Any, got: list[Any]) -> dict[str, float]:
    """Max |got - reference| / max |reference| of out, dx, dh, dg; the reference is the unfused add +
    F.rms_norm on the same inputs in fp32."""
    import torch.nn.functional as F

    xs, hs, ws = (t.detach().float().requires_grad_() for t in (x, h, norm.weight))
    out = F.rms_norm(xs + hs, [xs.shape[-1]], ws, norm.eps)
    out.backward(go.float())
    want = [out.detach(), xs.grad, hs.grad, ws.grad]
    return {name: ((a.float() - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("out", "dx", "dh", "dg"), got, want, strict=True)}


def one_path(path: str, o: argparse.Namespace) -> dict[str, Any]:
    """Run ``path`` in this process (module docstring)."""
    import torch
    from suite_cases import kernels, sync

    from megapost.kernels import norm_path
    from megapost.model.fusion import parse_fusion
    from megapost.model.norm import RMSNorm

    device = torch.device(o.device)
    if path != "torch" and norm_path(device) != path:
        return {"path": path, "skipped": f"{path} does not run on {device.type} here (norm_path: "
                                         f"{norm_path(device)})"}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[o.dtype]
    shape = [int(s) for s in o.shape.split(",")]
    gen = torch.Generator().manual_seed(0)
    x, h, go = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    x.requires_grad_(), h.requires_grad_()
    norm = RMSNorm(shape[-1]).to(device, dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(shape[-1], generator=gen).to(device, dtype))
    norm.fusion = parse_fusion(SPECS[path])

    def step() -> list[Any]:
        x.grad = h.grad = norm.weight.grad = None
        _, out = norm(x, h)
        out.backward(go)
        return [out.detach(), x.grad, h.grad, norm.weight.grad]

    errors = _errors(norm, x, h, go, step())
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
    """Every path of ``o.paths`` in its own process; the result with the triton / torch ratios."""
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    for path in o.paths.split(","):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        if path == "triton" and o.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--path", path, "--shape", o.shape,
               "--dtype", o.dtype, "--iters", str(o.iters), "--warmup", str(o.warmup), "--device", o.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=o.timeout, env=env)
        if proc.returncode:
            rows.append({"path": path, "error": proc.stderr.strip().splitlines()[-1][:300]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {"shape": o.shape, "dtype": o.dtype, "device": o.device, "rows": rows}
    by = {r["path"]: r for r in rows if "us_per_call" in r}
    if "torch" in by and "triton" in by:
        result["triton_over_torch_time"] = by["triton"]["us_per_call"] / by["torch"]["us_per_call"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4,2048,512")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--paths", default="torch,triton")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--path", help=argparse.SUPPRESS)  # the child: one path in this process
    o = p.parse_args()
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
    if "triton_over_torch_time" in result:
        print(f"triton / torch time per call: {result['triton_over_torch_time']:.3f}")
    if o.json:
        Path(o.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
