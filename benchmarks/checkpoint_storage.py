"""Storage library for megapost's checkpoints, decided by measurement: the same training state (fp32
masters + two Adam moments of a Llama-shaped model, as one rank's shard) written by

* ``megapost``: megapost.checkpoint.stream_write (safetensors format, streamed one tensor at a time),
* ``safetensors``: ``safetensors.torch.save_file`` (builds the file's bytes on the host first),
* ``dcp``: ``torch.distributed.checkpoint.save`` (DCP; what Megatron's ``torch_dist`` uses).

Each writer runs in a fresh process; printed: seconds, MB/s, bytes on disk / state bytes, peak RSS
growth during the write (psutil, sampled every 5 ms) / state bytes.

    python benchmarks/checkpoint_storage.py --mb 400
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

WRITERS = ("megapost", "safetensors", "dcp")


def _state(mb: int):
    import torch

    hidden = 1024
    rows = max(1, mb * (1 << 20) // (3 * 4 * hidden * 16))
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in range(16):  # 16 "parameters", each with fp32 master and two moments
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            state[f"{kind}/layers.{i}.weight"] = torch.randn(rows, hidden, generator=gen)
    return state


class Peak(threading.Thread):
    def __init__(self) -> None:
        import psutil

        super().__init__(daemon=True)
        self.proc, self.peak, self.stop = psutil.Process(), 0, False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)


def _child(writer: str, mb: int, out: str) -> None:
    import psutil
    import torch

    state = _state(mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = psutil.Process().memory_info().rss
    peak = Peak()
    peak.start()
    t0 = time.perf_counter()
    if writer == "megapost":
        from megapost.checkpoint.stream_write import write_safetensors

        write_safetensors(os.path.join(out, "shard.safetensors"), list(state.items()), {"megapost": "{}"})
    elif writer == "safetensors":
        from safetensors.torch import save_file

        save_file(state, os.path.join(out, "shard.safetensors"))
        fd = os.open(os.path.join(out, "shard.safetensors"), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=out)
        for name in os.listdir(out):
            fd = os.open(os.path.join(out, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    seconds = time.perf_counter() - t0
    peak.stop = True
    peak.join()
    written = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    del torch
    print(json.dumps({"writer": writer, "state_mb": nbytes / 1e6, "seconds": seconds,
                      "mb_per_s": nbytes / 1e6 / seconds, "bytes_ratio": written / nbytes,
                      "rss_growth_ratio": max(0, peak.peak - base) / nbytes}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=400, help="state size in MB")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", choices=WRITERS)
    p.add_argument("--out")
    a = p.parse_args()
    if a.child:
        _child(a.child, a.mb, a.out)
        return
    print(f"{'writer':12s} {'state MB':>9s} {'s':>6s} {'MB/s':>7s} {'bytes/state':>11s} "
          f"{'RSS growth/state':>16s}")
    for _ in range(a.repeats):
        for writer in WRITERS:
            out = tempfile.mkdtemp(prefix=f"ckpt-{writer}-", dir=os.environ.get("TMPDIR"))
            try:
                cmd = [sys.executable, __file__, "--child", writer, "--mb", str(a.mb), "--out", out]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(res.stdout.strip().splitlines()[-1])
            finally:
                shutil.rmtree(out, ignore_errors=True)
            print(f"{r['writer']:12s} {r['state_mb']:9.0f} {r['seconds']:6.2f} {r['mb_per_s']:7.0f} "
                  f"{r['bytes_ratio']:11.4f} {r['rss_growth_ratio']:16.3f}")


if __name__ == "__main__":
    main()
