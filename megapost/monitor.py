"""TensorBoard on the logging rank and the console line."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


class Monitor:
    """Writes scalars against the step and against tokens consumed; no-op off the logging rank."""

    def __init__(self, tensorboard_dir: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.writer: Any = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100, flush_secs=10)
        self._t0 = time.time()

    def scalars(self, prefix: str, values: dict[str, float], step: int, tokens: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, step)
            self.writer.add_scalar(f"{prefix}-vs-tokens/{name}", value, tokens)

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True, file=sys.stdout)

    def eta(self, step: int, start_step: int, total: int) -> str:
        done = step - start_step
        if done <= 0:
            return "?"
        remaining = (time.time() - self._t0) / done * (total - step)
        return time.strftime("%H:%M:%S", time.gmtime(remaining))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
