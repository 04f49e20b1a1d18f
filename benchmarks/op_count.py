"""Aten ops dispatched per layer per micro-batch by megapost's real training step (forward + backward +
the gradient-accumulation hooks), counted with ``megapost.utils.op_count.AtenOpCounter``.

    python benchmarks/op_count.py [--json OUT] [--flags "--kernel-fusion none"] [--device cpu|cuda]
        [--triton-interpret]

One optimizer step of the real Trainer (DeepSpeed engine, bf16, synthetic batches) is counted at the
paper's layer shape (width 512, 4 heads, FFN 1536: paper-180m's) for L in {1, 2} layers and m in {4, 8}
micro-batches, each case in a fresh process. Op counts do not depend on the sequence length or the
micro-batch size, so both are tiny (the default ``--seq 16 --micro 1``). With S(L, m) the ops of one step:

    per layer per micro-batch  = (S(2, 8) - S(1, 8) - S(2, 4) + S(1, 4)) / 4
    per layer per step (fixed) = S(2, 8) - S(1, 8) - 8 * per-layer-per-micro-batch   (optimizer share)
    per micro-batch outside the layers = (S(1, 8) - S(1, 4)) / 4 - per-layer-per-micro-batch
                                 (embedding, head, loss and their accumulation hooks)

"compute" ops read or write data (one kernel each on a GPU); views and allocations are listed apart.
On CPU some ops decompose differently than on CUDA (e.g. ``F.rms_norm`` is composite on CPU, one
fused kernel on CUDA); ``--device cuda`` counts the CUDA dispatch. ``--triton-interpret`` runs each case
with ``TRITON_INTERPRET=1``: the Triton kernels that replace ops on CUDA (add + RMSNorm, RoPE, the SwiGLU
gate) then run on CPU in Triton's interpreter, so the count is the ops a CUDA step dispatches, but for
the ops CPU and CUDA implement differently (attention's backward is one op on both).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

SHAPE = {"hidden": 512, "heads": 4, "ffn": 1536}  # paper-180m's layer (megapost.config.presets)


def count_case(layers: int, accum: int, o: argparse.Namespace) -> dict[str, Any]:
    """One step's op counts (after one uncounted step) in this process."""
    import torch
    from bench_common import build_trainer

    from megapost.utils.op_count import AtenOpCounter

    torch.manual_seed(0)
    b = argparse.Namespace(layers=layers, hidden=SHAPE["hidden"], seq=o.seq, micro=o.micro, accum=accum,
                           vocab=o.vocab)
    extra = ["--bf16", "--ffn-hidden-size", str(SHAPE["ffn"]), "--num-attention-heads", str(SHAPE["heads"]),
             "--log-interval", "1000", *shlex.split(o.flags)]
    trainer, _cfg, _args = build_trainer(b, extra)
    trainer.train_step(1)
    with AtenOpCounter() as ops:
        trainer.train_step(2)
    trainer.close()
    return {"compute": dict(ops.by_name), "metadata": dict(ops.metadata)}


def _fresh(layers: int, accum: int, o: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--case", f"{layers},{accum}", "--seq", str(o.seq),
           "--micro", str(o.micro), "--vocab", str(o.vocab), f"--flags={o.flags}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if o.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if o.triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"op_count case L={layers} m={accum} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def per_layer(cases: dict[tuple[int, int], dict[str, Any]], kind: str = "compute") -> tuple[Counter, Counter]:
    """(per layer per micro-batch, per layer per step) op Counters from the four cases."""
    c = {k: Counter(v[kind]) for k, v in cases.items()}
    names = set().union(*c.values())
    micro = Counter({n: (c[2, 8][n] - c[1, 8][n] - c[2, 4][n] + c[1, 4][n]) / 4 for n in names})
    step = Counter({n: c[2, 8][n] - c[1, 8][n] - 8 * micro[n] for n in names})
    return +micro, +step


def summary(flags: str, o: argparse.Namespace) -> dict[str, Any]:
    cases = {(layers, accum): _fresh(layers, accum, o) for layers in (1, 2) for accum in (4, 8)}
    micro, step = per_layer(cases)
    meta_micro, _ = per_layer(cases, "metadata")
    one = {m: sum(cases[1, m]["compute"].values()) for m in (4, 8)}
    outside = (one[8] - one[4]) / 4 - sum(micro.values())
    return {"flags": flags, "device": o.device, "triton_interpret": o.triton_interpret, "shape": SHAPE,
            "seq": o.seq, "micro": o.micro,
            "ops_per_layer_per_microbatch": sum(micro.values()),
            "ops_per_layer_per_step_fixed": sum(step.values()),
            "ops_per_microbatch_outside_layers": outside,
            "metadata_ops_per_layer_per_microbatch": sum(meta_micro.values()),
            "by_op": dict(micro.most_common()), "step_by_op": dict(step.most_common())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", default="", help="extra megapost flags for every case, one string")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--triton-interpret", action="store_true",
                   help="each case with TRITON_INTERPRET=1: the Triton kernels CUDA runs, on CPU (docstring)")
    p.add_argument("--json", help="write the summary here too")
    p.add_argument("--case", help=argparse.SUPPRESS)  # "layers,accum": one case, JSON on stdout
    o = p.parse_args()
    if o.case:
        layers, accum = map(int, o.case.split(","))
        print(json.dumps(count_case(layers, accum, o)))
        return
    result = summary(o.flags, o)
    r = result
    where = f"{o.device}{' (Triton interpreted)' if o.triton_interpret else ''}"
    print(f"flags {o.flags or '(defaults)'} on {where}: {r['ops_per_layer_per_microbatch']:g} compute ops "
          f"per layer per micro-batch (+{r['ops_per_layer_per_step_fixed']:g} per layer per step; "
          f"{r['metadata_ops_per_layer_per_microbatch']:g} view/metadata ops per layer per micro-batch; "
          f"{r['ops_per_microbatch_outside_layers']:g} per micro-batch outside the layers)")
    for name, n in result["by_op"].items():
        print(f"  {name:40s} {n:g}")
    if o.json:
        Path(o.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
