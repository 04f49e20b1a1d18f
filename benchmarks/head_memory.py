"""Peak memory of the LM head + loss, unfused (the head's GEMM, then megapost's blocked fp32
cross-entropy on the [tokens, vocab] logits) against the chunked head + cross-entropy
(``--kernel-fusion`` ce, ``megapost/kernels/linear_ce.py``), forward + backward with z-loss, each case in
a fresh process. Measured: the peak of live tensor bytes above the inputs (``LiveTensorMemory``: every
storage an op allocates, exact on any device), the process's peak RSS growth, the wall time of that
forward + backward (under the counting mode) and, with ``--timed``, of a second one without it; next to
them the planner's price (``megapost.plan.memory.head_bytes``:
saved + backward transient).

    python benchmarks/head_memory.py [--tokens 8192 --hidden 512 --vocab 32000] [--dtypes fp32,bf16]
        [--cases unfused,chunked] [--timed] [--device cpu|cuda] [--json OUT]

Defaults: the paper's head (micro-batch 4 x seq 2048 tokens, width 512, vocab 32000).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES = ("unfused", "chunked")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_case(case: str, dtype_name: str, o: argparse.Namespace) -> dict[str, Any]:
    """Run ``case`` in this process: peak live tensor bytes and RSS growth of one forward + backward."""
    import torch
    import torch.nn.functional as F

    from megapost.metrics.tensor_memory import LiveTensorMemory
    from megapost.model.loss import HeadOutput, lm_loss

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = torch.device(o.device)
    gen = torch.Generator().manual_seed(0)

    def step(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> None:
        out = HeadOutput(x, w) if case == "chunked" else F.linear(x, w)
        lm_loss(out, t, mask, z_loss=1e-4).backward()

    def inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(o.tokens, o.hidden, generator=gen).to(device, dtype).requires_grad_()
        w = (0.02 * torch.randn(o.vocab, o.hidden, generator=gen)).to(device, dtype).requires_grad_()
        t = torch.randint(0, o.vocab, (o.tokens,), generator=gen).to(device)
        return x, w, t, torch.ones(o.tokens, device=device)

    with LiveTensorMemory() as mem:
        args = inputs()
        base, rss0 = mem.current, _rss()
        mem.reset_peak()
        start = time.perf_counter()
        step(*args)
        first_s = time.perf_counter() - start
        peak = mem.peak - base
    row = {"case": case, "dtype": dtype_name, "peak_tensor_bytes": peak, "first_seconds": first_s,
           "peak_rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
    if o.timed:
        args = inputs()
        start = time.perf_counter()
        step(*args)
        row["seconds"] = time.perf_counter() - start
    return row


def planned(case: str, dtype_name: str, o: argparse.Namespace) -> int:
    """The planner's saved + backward-transient bytes of the head for this case (no final norm)."""
    from megapost.kernels.linear_ce import CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS
    from megapost.model import ModelConfig
    from megapost.model.loss import BLOCK_ELEMENTS, DEFAULT_BLOCK_ELEMENTS
    from megapost.plan.memory import head_bytes

    cfg = ModelConfig(vocab_size=o.vocab, hidden_size=o.hidden, num_attention_heads=1, seq_length=o.tokens,
                      norm_position="post", num_layers=1)
    chunk = CHUNK_ELEMENTS.get(o.device, DEFAULT_CHUNK_ELEMENTS) if case == "chunked" else None
    e = 4 if dtype_name == "fp32" else 2
    saved, transient = head_bytes(cfg, 1, 1, False, e, block_elements=BLOCK_ELEMENTS.get(
        o.device, DEFAULT_BLOCK_ELEMENTS), chunk_elements=chunk)
    return saved - e * o.tokens * o.hidden + transient  # the input x is not counted (held before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--timed", action="store_true", help="also time a second forward + backward")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--case", help=argparse.SUPPRESS)  # "case,dtype": one case in this process
    o = p.parse_args()
    if o.case:
        print(json.dumps(one_case(*o.case.split(","), o)))
        return
    rows = []
    for dtype_name in o.dtypes.split(","):
        for case in o.cases.split(","):
            cmd = [sys.executable, __file__, "--case", f"{case},{dtype_name}", "--tokens", str(o.tokens),
                   "--hidden", str(o.hidden), "--vocab", str(o.vocab), "--device", o.device,
                   *(["--timed"] if o.timed else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                sys.exit(f"head_memory case {case} {dtype_name} failed:\n{proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["planned_bytes"] = planned(case, dtype_name, o)
            rows.append(row)
            secs = (f"{row['seconds']:.2f} s" if "seconds" in row
                    else f"{row['first_seconds']:.2f} s (counted)")
            print(f"{dtype_name} {case:8s} peak tensors {row['peak_tensor_bytes'] / 2**20:8.1f} MiB "
                  f"(planner {row['planned_bytes'] / 2**20:8.1f} MiB), peak RSS +"
                  f"{row['peak_rss_growth_bytes'] / 2**20:8.1f} MiB, fwd+bwd {secs}")
            sys.stdout.flush()
    if o.json:
        Path(o.json).write_text(json.dumps({"tokens": o.tokens, "hidden": o.hidden, "vocab": o.vocab,
                                            "device": o.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
