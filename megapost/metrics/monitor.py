"""TensorBoard (and Weights & Biases, with --wandb-project when wandb is installed) on the logging rank,
and the console line."""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Any

TOKENS_TAG = "-vs-tokens/"  # tags whose step is tokens consumed, not the iteration


def drop_events_after(tb_dir: str, iteration: int, tokens: int, keep: frozenset[str] = frozenset()) -> int:
    """Rewrite each event file in ``tb_dir`` (but ``keep``) without the summaries past the resumed
    point: step > ``iteration`` (step > ``tokens`` for the ``-vs-tokens`` tags). Each file is replaced
    atomically; returns how many events were dropped. A resumed run thus never repeats a step."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(glob.glob(os.path.join(tb_dir, "*tfevents*"))):
        if os.path.basename(path) in keep or os.path.basename(path).startswith("."):
            continue
        kept, before = [], dropped
        for raw in RawEventFileLoader(path).Load():
            event = Event.FromString(raw)
            values = event.summary.value if event.HasField("summary") else ()
            limit = tokens if values and all(TOKENS_TAG in v.tag for v in values) else iteration
            if values and event.step > limit:
                dropped += 1
            else:
                kept.append(raw)
        if dropped > before:
            tmp = os.path.join(tb_dir, f".rewrite.tmp-{os.getpid()}")  # no 'tfevents': TB never reads it
            with open(tmp, "wb") as f:
                writer = RecordWriter(f)
                for raw in kept:
                    writer.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    return dropped


def wandb_settings(log: Any) -> dict[str, str | None] | None:
    """wandb.init's arguments from the logging config, or None when --wandb-project is not given."""
    if not getattr(log, "wandb_project", None):
        return None
    return {"project": log.wandb_project, "name": log.wandb_exp_name or None, "dir": log.wandb_save_dir}


def _wandb_run(settings: dict[str, str | None] | None) -> Any:
    """A wandb run (its mode, e.g. WANDB_MODE=offline, is wandb's own), or None without wandb."""
    if not settings:
        return None
    try:
        import wandb
    except ImportError:  # said at start-up (megapost.config.logging_flags)
        return None
    if settings.get("dir"):
        os.makedirs(str(settings["dir"]), exist_ok=True)
    return wandb.init(**{k: v for k, v in settings.items() if v is not None})


class Monitor:
    """Writes scalars against the step and against tokens consumed; no-op off the logging rank."""

    def __init__(self, tensorboard_dir: str | None, enabled: bool, max_queue: int = 100,
                 wandb: dict[str, str | None] | None = None) -> None:
        self.enabled = enabled
        self.writer: Any = None
        self.wandb: Any = _wandb_run(wandb) if enabled else None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=max_queue, flush_secs=10)
        self._t0 = time.time()

    def scalars(self, prefix: str, values: dict[str, float], step: int, tokens: int) -> None:
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{name}": value for name, value in values.items()}, step=step)
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, step)
            self.writer.add_scalar(f"{prefix}-vs-tokens/{name}", value, tokens)

    def resume(self, iteration: int, tokens: int) -> None:
        """Continue a run's TensorBoard directory from ``iteration``: drop what earlier writers logged
        after it (they ran past the checkpoint), so steps never repeat or go backward."""
        if self.writer is None:
            return
        self.writer.flush()
        own = getattr(self.writer.file_writer.event_writer, "_file_name", "")
        drop_events_after(self.writer.log_dir, iteration, tokens, frozenset({os.path.basename(own)}))
        for sub, _, files in os.walk(self.writer.log_dir):  # runs of their own (e.g. layers/L00)
            if sub != self.writer.log_dir and any("tfevents" in f for f in files):
                drop_events_after(sub, iteration, tokens)

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
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
