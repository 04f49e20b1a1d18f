"""A hook trace of one optimizer step of the real trainer: every gradient-reduction collective and the
end of every transformer block's backward, in the order they happen (for tests/test_grad_overlap.py)."""

from __future__ import annotations

from typing import Any

TRACED = 3  # the iteration whose last micro-batch is traced
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce")


def _trace(argv: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from megapost.model import TransformerBlock
    from megapost.pretrain import run
    from megapost.train.step import StepRunner

    events: list[str] = []
    saved = {name: getattr(dist, name) for name in REDUCTIONS}
    handles: list[Any] = []
    original = StepRunner.train_step  # what the training loop calls

    def traced(name: str) -> Any:
        def call(tensor: Any, *a: Any, **kw: Any) -> Any:
            events.append(f"{name}:{tensor.numel()}")
            return saved[name](tensor, *a, **kw)
        return call

    def train_step(self: StepRunner, step: int) -> Any:
        if step != TRACED:
            return original(self, step)
        blocks = [m for m in self.engine.module.modules() if isinstance(m, TransformerBlock)]
        for i, block in enumerate(blocks):
            handles.append(block.register_full_backward_hook(
                lambda *_a, i=i: events.append(f"block{i}_backward_end")))
        for name in REDUCTIONS:
            setattr(dist, name, traced(name))
        try:
            return original(self, step)
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            for h in handles:
                h.remove()

    StepRunner.train_step = train_step  # type: ignore[method-assign]
    try:
        history = run(argv)
    finally:
        StepRunner.train_step = original  # type: ignore[method-assign]
    return {"events": events, "losses": history["train_loss"]}


def trace(data: Any, world: int, flags: list[str]) -> list[dict[str, Any]]:
    from dist_utils import run_ranks

    argv = ["--data-path", str(data.prefix), "--tokenizer-model", str(data.tokenizer_model),
            "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "0",
            "--peak-tflops", "1", "--lr-warmup-iters", "1", "--seed", "7", *flags]
    return run_ranks(_trace, world, argv, timeout=600)
