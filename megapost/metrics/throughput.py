"""Throughput accounting: tokens/s, model TFLOP/s, MFU and memory."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch


def memory_gb(device: torch.device) -> float:
    """Max allocated on GPU, else peak RSS of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / (2**20 if sys.platform != "darwin" else 2**30)


class PeakMemory:
    """This rank's peak memory since ``reset()``, named for how it was measured: the CUDA allocator's
    max allocated, a ``LiveTensorMemory`` tracker's live tensor bytes, or else peak RSS (which is not
    tensor memory); ``planned`` is the planner's prediction for this rank (bytes)."""

    def __init__(self, device: torch.device, tracker: Any = None, planned: float = 0.0) -> None:
        self.device, self.tracker, self.planned = device, tracker, planned

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.reset_peak()

    def peak(self) -> tuple[float, str]:
        """(bytes, what they are)."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device)), "CUDA max allocated"
        if self.tracker is not None:
            return float(self.tracker.peak), "live tensors"
        return memory_gb(self.device) * 2**30, "peak RSS, not tensor memory"


class Throughput:
    """Interval timer: call ``tick(tokens)`` each step, ``report()`` at each log line."""

    def __init__(self, flops_per_token: float, world_size: int, peak_tflops: float,
                 causal_flops_per_token: float | None = None) -> None:
        """``flops_per_token`` in Megatron's convention (the headline MFU); ``causal_flops_per_token``
        (attention's causal half) gives ``mfu_causal`` beside it."""
        self.flops_per_token = flops_per_token
        self.causal_flops_per_token = causal_flops_per_token
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self._start = time.perf_counter()
        self._tokens = 0

    def tick(self, tokens: int) -> None:
        self._tokens += tokens

    def report(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        tflops = tokens_per_s * self.flops_per_token / 1e12 / self.world_size  # per device
        self._start, self._tokens = time.perf_counter(), 0
        out = {"tokens_per_sec": tokens_per_s, "tflops_per_device": tflops, "seconds": elapsed}
        if self.peak_tflops > 0:  # without a peak MFU is unknown: no key, never a logged 0.0
            out["mfu"] = mfu = tflops / self.peak_tflops
            if self.causal_flops_per_token:
                out["mfu_causal"] = mfu * self.causal_flops_per_token / self.flops_per_token
        return out
