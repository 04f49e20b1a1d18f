"""Host cost of one call of a Python-kernel torch op, the way megapost's Triton kernels are registered
(``megapost.kernels.triton_common.torch_op``: a schema and a Python kernel per device) against
``torch.library.custom_op``, with an empty kernel body, each case in a fresh process; an aten ``mul`` of
8 elements for scale. On a launch-bound step every op's host time is step time.

    python benchmarks/op_dispatch.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

CASES = ("torch_op", "custom_op", "aten_mul")


def one(case: str, calls: int) -> float:
    """Microseconds per call of ``case`` in this process."""
    x = torch.randn(8)
    if case == "torch_op":
        from megapost.kernels.triton_common import torch_op

        @torch_op("bench_dispatch_noop(Tensor x) -> Tensor")
        def _noop(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(0)

        fn = torch.ops.megapost.bench_dispatch_noop
    elif case == "custom_op":
        @torch.library.custom_op("bench::noop", mutates_args=())
        def fn(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(0)
    else:
        def fn(x: torch.Tensor) -> torch.Tensor:
            return x * 2
    for _ in range(1000):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.case:
        print(json.dumps(one(o.case, o.calls)))
        return
    us = {}
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", case, "--calls", str(o.calls)], check=True,
                             capture_output=True, text=True).stdout
        us[case] = json.loads(out.strip().splitlines()[-1])
        print(f"{case:10s} {us[case]:6.2f} us per call")
    print(f"custom_op / torch_op: {us['custom_op'] / us['torch_op']:.2f}")


if __name__ == "__main__":
    main()
