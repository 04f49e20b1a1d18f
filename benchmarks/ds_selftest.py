"""The DeepSpeed adapter's start-up self-test (megapost.ds_adapter.selftest): its time per run on a real
engine (fp32 ZeRO-0 and bf16), median of repeats. Run: python benchmarks/ds_selftest.py"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import add_model_args, build_trainer  # noqa: E402

from megapost.ds_adapter import selftest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=20)
    b = p.parse_args()
    for name, flags in (("fp32 ZeRO-0", ["--zero-stage", "0"]), ("bf16", ["--bf16"])):
        trainer, _, _ = build_trainer(b, flags)
        times = []
        for _ in range(b.repeats):
            start = time.perf_counter()
            problem = selftest.run(trainer.engine.ds)
            times.append(time.perf_counter() - start)
            assert problem is None, problem
        print(f"{name}: self-test {1e3 * statistics.median(times):.2f} ms (median of {b.repeats}; "
              f"max {1e3 * max(times):.2f} ms)")
        trainer.close()


if __name__ == "__main__":
    main()
