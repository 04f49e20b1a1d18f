"""Step time and bytes through each collective per (TP, PP, DP) layout, against Megatron's figures.

    python benchmarks/parallel_layouts.py                       # the default layouts, gloo on CPU
    python benchmarks/parallel_layouts.py --layouts 1x1x1,2x1x1-sp,2x2x2 --steps 5 --hidden 256

Each layout trains the same model and global batch through the DeepSpeed engine (ZeRO-1, fp32) on
TP*PP*DP gloo ranks. Step time is the slowest rank's, median over the steps after the first, and
is shown relative to 1x1x1 (on a machine with fewer cores than ranks it measures contention too).
Bytes are per optimizer step summed over all ranks: tensor-parallel mappings are counted by
``megapost.parallel.collectives.counting_comm``, everything DeepSpeed sends (data-parallel gradient and
ZeRO parameter traffic, pipeline sends, DeepSpeed's pipe-partition gathers over TP, loss
broadcasts) by wrapping ``torch.distributed`` before DeepSpeed starts. The payload convention is
the full tensor of each call (the all-reduced tensor, the gathered output, the reduce-scattered
input); ring wire bytes are 2(n-1)/n of that for an all-reduce and (n-1)/n for the others.

Analytical figures (Korthikanti et al. 2022, per micro-batch with E = b*s*h elements): each
transformer layer all-reduces 4E under TP (2 forward, 2 backward), or under sequence parallelism
all-gathers 4E and reduce-scatters 4E (same wire bytes); the embedding and the LM head add E each
way; vocab-parallel cross-entropy all-reduces 3*b*s; sequence-parallel norm parameters all-reduce their
gradients (h each, h + 1 for DyT), per-head Q/K(/V) norm gains (--qk-norm, HybridNorm) theirs under
any TP. Data parallelism moves the rank's gradients (params x 4 bytes) once; pipeline stages send E
(E/tp when sharded) per boundary and direction.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dist_utils import RunSpec, run_ranks, tiny_config, train_layout  # noqa: E402

from megapost.model import ModelConfig  # noqa: E402
from megapost.model.placements import PLACEMENTS  # noqa: E402
from megapost.plan.counts import stage_layers  # noqa: E402

BYTES = 4  # fp32
DEFAULT_LAYOUTS = "1x1x1,2x1x1,2x1x1-sp,1x2x1,1x1x2,2x2x1,2x2x1-sp,2x1x2,1x2x2,2x2x2,2x2x2-sp"

# torch.distributed op -> (keyword, position) of the tensor(s) whose size is the payload
_PAYLOAD_ARG = {
    "all_reduce": ("tensor", 0), "broadcast": ("tensor", 0), "send": ("tensor", 0),
    "all_gather_into_tensor": ("output_tensor", 0), "all_gather_single": ("output_tensor", 0),
    "reduce_scatter_tensor": ("input", 1), "reduce_scatter_single": ("input", 1),
    "all_gather": ("tensor_list", 0), "reduce_scatter": ("input_list", 1),
    "all_reduce_coalesced": ("tensors", 0),
}
DS_BYTES: dict[str, int] = defaultdict(int)


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size()


def install_counters() -> None:
    """Wrap torch.distributed's collectives (in each rank, before DeepSpeed captures them) to count
    the bytes of calls not made by megapost's own mappings, while the counting block counts."""
    import torch.distributed as dist

    from megapost.parallel.collectives import active_counter

    def wrap(op: str, fn: Any) -> Any:
        key, pos = _PAYLOAD_ARG[op]

        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            counter = active_counter()  # train_layout's counting block
            if counter is not None and counter.enabled and caller != "megapost.parallel.collectives":
                DS_BYTES[op] += _nbytes(kwargs[key] if key in kwargs else args[pos])
            return fn(*args, **kwargs)

        return counted

    for op in _PAYLOAD_ARG:
        if hasattr(dist, op):
            setattr(dist, op, wrap(op, getattr(dist, op)))


def bench_rank(spec: RunSpec) -> dict[str, Any]:
    result = train_layout(spec)
    result["ds_bytes"] = dict(DS_BYTES)
    return result


def parse_layout(text: str) -> tuple[int, int, int, bool]:
    dims, _, flag = text.partition("-")
    tp, pp, dp = (int(x) for x in dims.split("x"))
    return tp, pp, dp, flag == "sp"


def tp_reduced_gradients(cfg: ModelConfig, layers: range, first: bool, last: bool, sp: bool) -> int:
    """Elements of the replicated gradients a rank all-reduces over TP per micro-batch: the per-head
    Q/K(/V) norm gains under any TP; under SP also every residual-stream norm's parameters and DyT's
    embedding scalar (``megapost/parallel/parallelize.py``)."""
    n = 0
    for layer in layers:
        heads = (3 if cfg.rules(layer)[0].qkv_norm else 2 if cfg.qk_norm else 0) * cfg.head_dim
        n += heads + (cfg.layer_norm_parameters(layer) - heads if sp else 0)
    if sp:
        n += (1 if first and cfg.norm_kind == "dyt" else 0) + (cfg.norm_parameters if last and cfg.final_norm
                                                                 else 0)
    return n


def analytical(r: dict[str, Any], spec: RunSpec, model: dict[str, Any], tp: int, sp: bool,
               pp: int) -> dict[str, float]:
    """Megatron's per-step payload bytes for one rank (see the module docstring)."""
    m, b, s, h = r["gas"], spec.micro_batch, model["seq_length"], model["hidden_size"]
    e, tokens = b * s * h, b * s
    layers, first, last = r["local_layers"], r["first_stage"], r["last_stage"]
    out = {"tp_all_reduce": 0.0, "tp_all_gather": 0.0, "tp_reduce_scatter": 0.0}
    if tp > 1:
        cfg = tiny_config(**model)
        start = sum(stage_layers(cfg.num_layers, pp)[:r["coord"][1]]) + 1
        gains = tp_reduced_gradients(cfg, range(start, start + layers), first, last, sp)
        ce = 3 * tokens if last else 0
        if sp:
            per_micro = 4 * layers * e + first * e + last * e
            out["tp_all_gather"] = out["tp_reduce_scatter"] = m * per_micro * BYTES
            out["tp_all_reduce"] = m * (ce + gains) * BYTES
        else:
            out["tp_all_reduce"] = m * (4 * layers * e + first * e + last * e + ce + gains) * BYTES
    out["dp_grads"] = r["local_params"] * BYTES if r.get("dp", 1) > 1 else 0.0
    boundary = e / tp if tp > 1 else e
    out["pp_send"] = m * ((not last) + (not first)) * boundary * BYTES if pp > 1 else 0.0
    return out


def run(layouts: list[str], spec_kw: dict[str, Any], model: dict[str, Any]) -> None:
    rows = []
    for text in layouts:
        tp, pp, dp, sp = parse_layout(text)
        spec = RunSpec(tp=tp, pp=pp, sp=sp, count_comm=True, return_params=False, model=model, **spec_kw)
        ranks = run_ranks(bench_rank, tp * pp * dp, spec, setup=install_counters)
        steps = list(zip(*(r["step_times"] for r in ranks), strict=True))[1:]
        step_time = statistics.median(max(t) for t in steps)
        timed = spec.steps - 1
        measured: dict[str, float] = defaultdict(float)
        expected: dict[str, float] = defaultdict(float)
        for r in ranks:
            for op, nbytes in r["tp_bytes"].items():
                measured[f"tp_{op}"] += nbytes / timed
            for op, nbytes in r["ds_bytes"].items():
                measured[f"ds_{op}"] += nbytes / timed
            for key, value in analytical({**r, "dp": dp}, spec, model, tp, sp, pp).items():
                expected[key] += value
        rows.append((text, tp * pp * dp, step_time, measured, expected))
        print(f"  {text}: {step_time * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    _print(rows)


def _mb(x: float) -> str:
    return f"{x / 2**20:8.2f}"


def _pair(measured: float, expected: float) -> str:
    return f"{_mb(measured)} /{_mb(expected)}"


def _print(rows: list[tuple[str, int, float, dict[str, float], dict[str, float]]]) -> None:
    base = next((t for name, _, t, _, _ in rows if name == "1x1x1"), rows[0][2])
    print("\nstep time: slowest rank, median | bytes per step summed over ranks, MiB (measured / Megatron)")
    head = (f"{'layout':<10}{'ranks':>5}{'ms':>9}{'rel':>7} | {'TP all-reduce':>19}{'TP all-gather':>19}"
            f"{'TP reduce-scat':>19} | {'DP grads*':>9} | {'PP send':>19} | DeepSpeed ops measured")
    print(head)
    print("-" * len(head))
    for name, n, t, meas, exp in rows:
        tp = "".join(_pair(meas.get(f"tp_{op}", 0.0), exp[f"tp_{op}"])
                     for op in ("all_reduce", "all_gather", "reduce_scatter"))
        ds_ops = sorted((k[3:], v) for k, v in meas.items() if k.startswith("ds_") and v)
        ds = ", ".join(f"{op} {_mb(v).strip()}" for op, v in ds_ops)
        print(f"{name:<10}{n:>5}{t * 1e3:>9.1f}{t / base:>7.2f} | {tp} | {_mb(exp['dp_grads'])} | "
              f"{_pair(meas.get('ds_send', 0.0), exp['pp_send'])} | {ds}")
    print("* DP grads: analytical gradient payload (params on each rank x 4 B, summed over ranks); "
          "DeepSpeed's data-parallel\n  traffic is among its measured ops (ZeRO-1 also all-gathers the "
          "updated parameters; it calls its gradient all-reduce even on a data-parallel group of one).")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated TPxPPxDP[-sp]")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per layout (the first is not timed)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--norm-position", choices=PLACEMENTS, default="pre")
    p.add_argument("--qk-norm", action="store_true")
    a = p.parse_args(argv)
    model = dict(num_layers=a.num_layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                 ffn_hidden_size=a.ffn, vocab_size=a.vocab, seq_length=a.seq, norm_position=a.norm_position,
                 qk_norm=a.qk_norm)
    spec_kw = dict(steps=a.steps, global_batch=a.global_batch, micro_batch=a.micro_batch)
    run([x.strip() for x in a.layouts.split(",") if x.strip()], spec_kw, model)


if __name__ == "__main__":
    main()
