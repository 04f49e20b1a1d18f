"""The MFU peak: datasheet table by device name, --peak-tflops, and the cached CPU measurement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from megapost.metrics import peak_flops
from megapost.metrics.peak_flops import Peak, cache_file, resolve_peak, table_peak
from megapost.metrics.throughput import Throughput
from megapost.train.logger import mfu_text

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,precision,tflops,entry", [
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0, "NVIDIA A100"),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0, "NVIDIA A100"),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5, "NVIDIA A100"),
    ("NVIDIA A100-PCIE-40GB", "bf16", 312.0, "NVIDIA A100"),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5, "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "bf16", 756.5, "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "bf16", 835.5, "NVIDIA H100 NVL"),
    ("NVIDIA H200", "bf16", 989.5, "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", "bf16", 835.5, "NVIDIA H200 NVL"),
    ("NVIDIA GH200 480GB", "bf16", 989.5, "NVIDIA GH200"),
    ("NVIDIA L40S", "bf16", 362.05, "NVIDIA L40S"),
    ("NVIDIA A10", "bf16", 125.0, "NVIDIA A10"),
    ("NVIDIA RTX A6000", "fp32", 38.7, "NVIDIA RTX A6000"),
    ("Tesla V100-SXM2-32GB", "fp32", 15.7, "NVIDIA V100 SXM2"),
    ("Tesla V100-PCIE-16GB", "fp32", 14.0, "NVIDIA V100 PCIe"),
    ("AMD Instinct MI250X", "bf16", 191.5, "AMD Instinct MI250X (one GCD)"),
    ("AMD Instinct MI300X", "bf16", 1307.4, "AMD Instinct MI300X"),
    ("NVIDIA B200", "bf16", 2250.0, "NVIDIA HGX B200"),
    ("NVIDIA GB200", "bf16", 2500.0, "NVIDIA GB200 (one GPU)"),
    ("NVIDIA H800", "bf16", 989.5, "NVIDIA H800 SXM"),
    ("NVIDIA H800 PCIe", "bf16", 756.5, "NVIDIA H800 PCIe"),
    ("NVIDIA H20", "bf16", 148.0, "NVIDIA H20"),
    ("NVIDIA L4", "bf16", 121.0, "NVIDIA L4"),
    ("NVIDIA A10G", "bf16", 70.0, "NVIDIA A10G"),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2, "NVIDIA GeForce RTX 4090"),
])
def test_table_lookup_by_device_name(name: str, precision: str, tflops: float, entry: str) -> None:
    peak = table_peak(name, precision)
    assert peak == Peak(tflops, f"table: {name} = {entry} {precision} dense")
    assert peak.describe() == f"{tflops:.4g} TFLOP/s/device (table: {name} = {entry} {precision} dense)"


def test_unknown_devices_and_precisions_are_not_guessed() -> None:
    assert table_peak("NVIDIA A10G", "bf16").tflops == 70.0  # not the A10
    assert table_peak("NVIDIA RTX 6000 Ada Generation", "bf16") is None
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 units: measure instead


def test_peak_tflops_flag_wins(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops, "measure_matmul_tflops", lambda *a: pytest.fail("measured"))
    assert resolve_peak(123.0, torch.bfloat16, CPU) == Peak(123.0, "--peak-tflops")
    assert not cache_file().exists()


def _idle(monkeypatch, others: float = 0.0) -> None:
    """The machine as idle (or ``others`` cores busy) while measuring, whatever else runs beside the test."""
    monkeypatch.setattr(peak_flops, "load_average", lambda: 0.0)
    monkeypatch.setattr(peak_flops, "others_busy", lambda fn: (fn(), others))


def test_cpu_measurement_is_cached_per_machine_and_dtype(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _idle(monkeypatch)
    calls = []

    def fake_measure(dtype, device):
        calls.append(dtype)
        return {torch.float32: 0.5, torch.bfloat16: 1.25}[dtype] * len(calls)

    monkeypatch.setattr(peak_flops, "measure_matmul_tflops", fake_measure)
    first = resolve_peak(0.0, torch.bfloat16, CPU)
    assert first.tflops == 1.25
    assert "measured bf16 matmul on this CPU, best of several sizes x 3 runs, cached in" in first.source
    again = resolve_peak(0.0, torch.bfloat16, CPU)
    assert again.tflops == 1.25 and calls == [torch.bfloat16]  # reused, not measured again
    date = json.loads(cache_file().read_text()).popitem()[1]["date"]
    assert f"cached {date} in {cache_file()}; --remeasure-peak to renew" in again.source
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 1.0  # another dtype: its own entry
    assert resolve_peak(0.0, torch.bfloat16, CPU, remeasure=True).tflops == 3 * 1.25
    assert resolve_peak(0.0, torch.bfloat16, CPU).tflops == 3 * 1.25 and len(calls) == 3
    assert len(json.loads(cache_file().read_text())) == 2


def test_cached_cpu_peak_of_another_torch_or_thread_count_is_not_used(monkeypatch, tmp_path) -> None:
    """The shared cache holds figures of other setups: only this torch version and thread count's is read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _idle(monkeypatch)
    calls = []
    monkeypatch.setattr(peak_flops, "measure_matmul_tflops", lambda *a: calls.append(1) or 0.25 * len(calls))
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 0.25
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 0.5  # another torch: measured again
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 3)
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 0.75  # another thread count: measured again
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 0.75 and len(calls) == 3  # its own entry reused
    assert len(json.loads(cache_file().read_text())) == 3


def test_peak_measured_on_a_busy_cpu_is_refused_and_not_cached(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops, "measure_matmul_tflops", lambda *a: 0.01)
    _idle(monkeypatch, others=1.0)
    peak = resolve_peak(0.0, torch.float32, CPU)
    assert peak.tflops == 0.0 and "CPU busy while measuring" in peak.source and "not cached" in peak.source
    assert not cache_file().exists()
    _idle(monkeypatch, others=0.2)  # noise below half a core: measured and cached
    assert resolve_peak(0.0, torch.float32, CPU).tflops == 0.01 and cache_file().exists()


@pytest.mark.integration
def test_other_processes_busy_cores_are_seen() -> None:
    """A spinning child process keeps about one core busy while this one sleeps (/proc/stat)."""
    from megapost.utils.machine import others_busy

    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        _, busy = others_busy(lambda: time.sleep(1.5))
    finally:
        child.wait()
    assert busy > 0.6, busy  # the busy-peak refusal's threshold is 0.5 core


def test_measurement_is_the_best_of_several_runs() -> None:
    tflops = peak_flops.measure_matmul_tflops(torch.float32, CPU, sizes=(64, 128), reps=2)
    assert 0 < tflops < 100


@pytest.mark.integration
def test_impossible_mfu_is_flagged_once(tiny_data, tmp_path) -> None:
    """A peak below what the run achieves (a CPU peak measured on a busy machine) is named, once."""
    from launch_utils import pretrain, tiny_model_flags

    out = pretrain(tiny_model_flags(tiny_data, **{"--peak-tflops": 1e-9, "--train-iters": 3,
                                                 "--runs-dir": tmp_path / "runs"})).stdout
    assert out.count("warning: MFU") == 1 and "--remeasure-peak" in out
    assert "MFU n/a (above 100%" in out and not re.search(r"\| MFU \d", out)  # never a figure > 100%
    quiet = pretrain(tiny_model_flags(tiny_data, **{"--peak-tflops": 1e6, "--train-iters": 2,
                                                   "--runs-dir": tmp_path / "runs2"})).stdout
    assert "warning: MFU" not in quiet


def test_mfu_in_megatron_convention_with_the_causal_half_beside() -> None:
    from megapost.metrics.throughput import Throughput
    from megapost.model import ModelConfig

    cfg = ModelConfig(vocab_size=256, num_layers=3, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, seq_length=32)
    # Megatron-LM counts QK^T and PV in full: 12·L·s·d per token (fwd+bwd); the causal half is 6·L·s·d
    assert cfg.flops_per_token() - cfg.flops_per_token(causal=True) == 6 * 3 * 32 * 64
    th = Throughput(cfg.flops_per_token(), 1, 1.0, cfg.flops_per_token(causal=True))
    th.tick(1000)
    perf = th.report()
    assert perf["mfu_causal"] == pytest.approx(perf["mfu"] * cfg.flops_per_token(causal=True)
                                               / cfg.flops_per_token())


def test_unlisted_gpu_says_mfu_unknown(monkeypatch) -> None:
    monkeypatch.setattr(peak_flops, "device_name", lambda device: "NVIDIA Future GPU")
    peak = resolve_peak(0.0, torch.bfloat16, torch.device("cuda", 0))
    assert peak.tflops == 0.0 and "MFU unknown: pass --peak-tflops" in peak.source
    assert peak.describe().startswith("unknown (") and "TFLOP/s/device" not in peak.describe()


def test_unknown_peak_logs_no_mfu() -> None:
    """No peak: MFU is absent from the report (so never logged as throughput/mfu 0.0), and the log
    line says it is unknown."""
    meter = Throughput(flops_per_token=6e6, world_size=1, peak_tflops=0.0, causal_flops_per_token=5e6)
    meter.tick(1000)
    perf = meter.report()
    assert not {k for k in perf if k.startswith("mfu")} and perf["tflops_per_device"] > 0
    assert mfu_text(perf, 0.0) == "MFU unknown: pass --peak-tflops"
