"""The per-device peak TFLOP/s that MFU divides by, and where that figure came from.

Order: ``--peak-tflops``; else the vendor datasheet table below for a known accelerator (matched by
``torch.cuda.get_device_name()``); else a matmul peak measured on this machine (best of several sizes
and repetitions) and cached per machine, thread count, torch version and dtype in
``~/.cache/megapost/peak_tflops.json`` (``--remeasure-peak`` measures again).  A CPU figure measured while
other processes kept cores busy (the load average before, /proc/stat during the measurement) is refused:
not cached, MFU unknown.

Table values are dense (no 2:4 sparsity) tensor-core TFLOP/s per device as torch sees it (one MI250X
GCD is one device: half the module's figure).  ``tf32`` is used for fp32 training when torch lets
matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``), else ``fp32`` (plain FP32 units).
Sources: the NVIDIA B200/GB200 (HGX, NVL72), A100, H100, H800, H20, H200, GH200, L40S, L4, A10, A10G,
RTX A6000, RTX 4090 (Ada whitepaper, FP32 accumulate) and V100 datasheets, and AMD's
Instinct MI250X and MI300X datasheets (sparse figures halved where a sheet gives only those).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megapost.utils.atomic import atomic_write_text
from megapost.utils.machine import load_average, local_ranks, others_busy

# (pattern on the device name, table name, {precision: dense TFLOP/s}); first match wins.
PEAK_TABLE: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"GB200", "NVIDIA GB200 (one GPU)", {"bf16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    (r"B200", "NVIDIA HGX B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"GH200", "NVIDIA GH200", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"H800.*PCIe", "NVIDIA H800 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"H800", "NVIDIA H800 SXM", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"\bH20\b", "NVIDIA H20", {"bf16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    (r"H200 NVL", "NVIDIA H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", "NVIDIA H200 SXM", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"H100 NVL", "NVIDIA H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"H100", "NVIDIA H100 SXM", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"A100", "NVIDIA A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "NVIDIA L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bA10G\b", "NVIDIA A10G", {"bf16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"RTX 4090", "NVIDIA GeForce RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX A6000", "NVIDIA RTX A6000", {"bf16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"V100S", "NVIDIA V100S PCIe", {"fp32": 16.4}),  # no bf16 / tf32 units: bf16 runs are measured
    (r"V100.*PCIE", "NVIDIA V100 PCIe", {"fp32": 14.0}),
    (r"V100", "NVIDIA V100 SXM2", {"fp32": 15.7}),
    (r"MI250X", "AMD Instinct MI250X (one GCD)", {"bf16": 191.5, "fp32": 47.9}),
    (r"MI300X", "AMD Instinct MI300X", {"bf16": 1307.4, "fp32": 163.4}),
)
_SIZES = (512, 1024, 2048)
# On a CPU the best rate can come at small sizes (emulated bf16 gets slower as matrices grow: 64 beats
# 1024 by ~7x on AVX2), and a model's matmuls are small: start at 64 and grow while a run takes < 0.5 s.
_CPU_SIZES = (64, 128, 256, 512, 1024, 2048)
_CPU_MAX_S = 0.5
_REPS = 3
METHOD = "v2"  # in the cache key: figures measured by an older method are measured again


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str

    def describe(self) -> str:
        """``989 TFLOP/s/device (table: NVIDIA H100 SXM bf16 dense)``; ``unknown (...)`` without one."""
        if self.tflops <= 0:
            return f"unknown ({self.source})"
        return f"{self.tflops:.4g} TFLOP/s/device ({self.source})"


def precision_of(dtype: torch.dtype, device: torch.device) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak(device_name: str, precision: str) -> Peak | None:
    """The datasheet figure for ``device_name`` at ``precision``, or None when the table has none."""
    for pattern, name, peaks in PEAK_TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if precision not in peaks:
                return None
            return Peak(peaks[precision], f"table: {device_name} = {name} {precision} dense")
    return None


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...] = _SIZES,
                          reps: int = _REPS) -> float:
    """Best achieved TFLOP/s of square matmuls over ``sizes`` x ``reps`` timed runs (after a warm-up):
    the best run is the one least disturbed by other work on the machine."""
    best = 0.0
    if device.type == "cpu" and sizes is _SIZES:
        sizes = _CPU_SIZES
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            took = max(time.perf_counter() - start, 1e-9)
            best = max(best, 2 * size**3 / took / 1e12)
        if device.type == "cpu" and took > _CPU_MAX_S:
            break
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megapost" / "peak_tflops.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return model


def machine_key(device: torch.device, precision: str) -> str:
    """What a measured figure depends on: host, device model, CPU threads, precision, torch's version (its
    CPU matmul kernels change between releases), the method; under any other a figure is stale."""
    threads = f"threads={torch.get_num_threads()}" if device.type == "cpu" else device.type
    return (f"{platform.node()} | {device_name(device)} | {threads} | {precision} | "
            f"torch {torch.__version__} | {METHOD}")


def measured_peak(dtype: torch.dtype, device: torch.device, remeasure: bool = False) -> Peak:
    """The cached measurement for this machine and dtype, measuring (and caching) it when absent."""
    precision = precision_of(dtype, device)
    key, path = machine_key(device, precision), cache_file()
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    where = f"measured {precision} matmul on this {'CPU' if device.type == 'cpu' else 'device'}"
    if not remeasure and isinstance(cache.get(key), dict) and cache[key].get("tflops", 0) > 0:
        entry = cache[key]
        return Peak(float(entry["tflops"]), f"{where}, cached {entry.get('date', '?')} in {path}; "
                                            "--remeasure-peak to renew, --peak-tflops to set")
    busy_before = max(0.0, load_average() - local_ranks())
    tflops, busy = others_busy(lambda: measure_matmul_tflops(dtype, device))
    busy = max(busy, busy_before)
    if device.type == "cpu" and busy > busy_allowance():
        return Peak(0.0, f"CPU busy while measuring its peak (other processes kept {busy:.1f} cores busy; "
                    f"measured {tflops:.4g} TFLOP/s, not cached): MFU unknown; --peak-tflops to set, or "
                    "measure again on an idle machine (--remeasure-peak)")
    cache[key] = {"tflops": tflops, "date": time.strftime("%Y-%m-%d %H:%M"),
                  "sizes": list(_CPU_SIZES if device.type == "cpu" else _SIZES), "reps": _REPS}
    try:
        atomic_write_text(path, json.dumps(cache, indent=1, sort_keys=True) + "\n")
        stored = f"cached in {path}"
    except OSError as e:
        stored = f"not cached: {e.strerror}"
    return Peak(tflops, f"{where}, best of several sizes x {_REPS} runs, {stored}")


def busy_allowance() -> float:
    """Cores other processes may keep busy while this rank measures: its sibling ranks' threads (they
    measure alike, each on its share of the cores), plus half a core of noise."""
    return (local_ranks() - 1) * torch.get_num_threads() + 0.5


def resolve_peak(peak_tflops: float, dtype: torch.dtype, device: torch.device,
                 remeasure: bool = False) -> Peak:
    """``--peak-tflops`` if given, else the datasheet table; an unlisted GPU gets 0 ("MFU unknown"); a
    CPU the cached/measured figure."""
    if peak_tflops and peak_tflops > 0:
        return Peak(float(peak_tflops), "--peak-tflops")
    if device.type == "cuda":
        known = table_peak(device_name(device), precision_of(dtype, device))
        if known is not None:
            return known
        # a small-matmul timing understates a big GPU's peak and so overstates MFU: do not guess
        return Peak(0.0, f"{device_name(device)} not in the datasheet table: MFU unknown: pass --peak-tflops")
    return measured_peak(dtype, device, remeasure)
