"""The GPU suite's planned schedule (benchmarks/gpu_suite.py): which call runs which case, each case's
time estimate, and the check that each must-show call fits its budget.

The must-show rows (issue 48) in two calls of <= 300 s each (the device's per-call limit is 600 s and a
session's whole lease 15 min, the machine's start included); the rest ("extra") runs only on time left:

- part 1: paper-180m eager at 4 x 8 and at the planner's micro-batch (16 x 2 on an H100/H200: MFU,
  kernels per step, busy fraction, memory against the planner), collapse_metrics at intervals 1 and 10
  (the plugin's overhead), ``--no-triton-kernels`` (Triton vs the torch paths), the real command against
  the benchmark;
- part 2: CUDA-graphed paper-180m at both micro-batches, the Hugging Face peer;
- extra: ``--kernel-fusion none``, the head's memory, the Triton ops one by one, ``--compile``, the
  1.3B/7B-width slices, ``--async-save``.

Estimates, first principles (none measured on a GPU since the fusions): a fresh process imports torch,
DeepSpeed and megapost and builds the engine in ~15 s; a paper-180m step (65,536 tokens, ~1.0e14 FLOP)
takes ~0.76 s at the one measured speed (13.2 % MFU on an H200), so a case's 3 warm-up, 10 timed and one
profiled step ~11 s; the first case also JIT-compiles the Triton kernels (~15 s, cached after); a
plugin case adds its measured steps; the real command runs 33 steps of its own start-up (data, logging);
``--compile`` / CUDA graphs add Inductor's compile of the block and the graphs' capture (~60-80 s)."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

MUST_SHOW = ("1", "2")  # the calls that must fit --budget-s each
PARTS = (*MUST_SHOW, "extra")


def schedule(todo: list[tuple[str, float, Any, str]], part: str, budget_s: float) -> tuple[str, bool]:
    """The planned schedule of ``todo``'s (name, estimate s, fn, part) rows that ``part`` ("1", "2",
    "extra" or "all") runs, each must-show part's sum against ``budget_s``; and whether every must-show
    part in it fits."""
    lines, ok = [f"planned schedule (--part {part}, --budget-s {budget_s:.0f} per call; estimates on one "
                 "H100/H200):"], True
    for p in PARTS if part == "all" else (part,):
        rows = [(name, est) for name, est, _, case_part in todo if case_part == p]
        total = sum(est for _, est in rows)
        lines += [f"  part {p:5s} {est:5.0f} s  {name}" for name, est in rows]
        if p in MUST_SHOW:
            fits = total <= budget_s
            ok &= fits
            lines.append(f"  part {p:5s} {total:5.0f} s of {budget_s:.0f} s: "
                         f"{'fits' if fits else 'FAIL: the sum exceeds the budget'}")
        else:
            lines.append(f"  part {p:5s} {total:5.0f} s planned: best effort (a case past the budget is "
                         "skipped, its row says so)")
    return "\n".join(lines), ok


def planned_micro(shape: tuple, memory_gb: float) -> int:
    """The planner's recommended micro-batch for ``shape`` on one GPU at the same global batch."""
    from megapost.plan.__main__ import parse, plan

    layers, hidden, ffn, heads, groups, seq, micro, accum, vocab = shape
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--seq-length", str(seq), "--vocab-size", str(vocab),
            "--global-batch-size", str(micro * accum), "--gpus", "1", "--gpu-memory-gb", str(memory_gb)]
    best = plan(parse(argv))["recommended"]
    return best["layout"]["micro_batch"] if best else micro


def gpu_schedule(o: argparse.Namespace, cases: Callable[[argparse.Namespace], list], paper: tuple,
                 memory_gb: float) -> tuple[str, bool]:
    """``schedule`` of the GPU's cases (the paper's shape, the planner's micro-batch for ``memory_gb``)
    for ``o.part`` against ``o.budget_s``, whatever this run's device (the dry run prints it too)."""
    gpu = copy.copy(o)
    gpu.dry_run, gpu.recommended_micro = False, planned_micro(paper, memory_gb)
    return schedule(cases(gpu), o.part, o.budget_s)
