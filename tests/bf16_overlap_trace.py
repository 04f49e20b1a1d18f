"""One launch of DP ranks training the real trainer twice, bf16 ZeRO-1 with several micro-batches per step:
``--no-overlap-grad-reduce`` (DeepSpeed's one blocking reduction after backward) and
``--overlap-grad-reduce`` (megapost.ds_adapter.overlap), for tests/test_bf16_overlap.py.

Of the overlapped run's step ``TRACED`` it records, in order: every gradient all-reduce launched (the
bucket it reduces, whether it was asynchronous), every transformer block's backward end, the end of
each micro-batch's backward, each handle's ``wait()``, the boundary reduction's entry and the optimizer
step. Of both runs: losses, grad norms, the bf16 weights and this rank's fp32 master fragments."""

from __future__ import annotations

from typing import Any

import torch

TRACED = 3  # the optimizer step whose micro-batches are traced


class _Handle:
    """A work handle that records its ``wait()``."""

    def __init__(self, work: Any, events: list[str], name: str) -> None:
        self._work, self._events, self._name = work, events, name

    def wait(self, *a: Any, **kw: Any) -> Any:
        self._events.append(f"wait:{self._name}")
        return self._work.wait(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _bucket_of(overlap: Any, tensor: torch.Tensor) -> int | None:
    for k, b in enumerate(overlap.buckets):
        if b.view.data_ptr() == tensor.data_ptr() and b.view.numel() == tensor.numel():
            return k
    return None


def _layout(engine: Any, overlap: Any) -> list[dict[str, Any]]:
    """Per bucket: elements, and the lowest transformer-block index of its parameters (-1: the
    embedding; the number of blocks: head and final norm only)."""
    from megapost.model import TransformerBlock

    blocks = [m for m in engine.module.modules() if isinstance(m, TransformerBlock)]
    where = {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}
    emb = {id(p) for n, p in engine.module.named_parameters() if "embed" in n}
    params = engine.optimizer.bf16_groups
    out = []
    for b in overlap.buckets:
        idx = [(-1 if id(params[b.group][j]) in emb else where.get(id(params[b.group][j]), len(blocks)))
               for j in b.params]
        out.append({"numel": b.numel, "group": b.group, "lowest_block": min(idx)})
    return out


def _traced_step(self: Any, step: int, original: Any, out: dict[str, Any]) -> Any:
    import torch.distributed as dist

    from megapost.ds_adapter import overlap as ds_overlap
    from megapost.model import TransformerBlock

    engine, events = self.engine.ds, out["events"]  # DeepSpeed's engine
    overlap = ds_overlap.installed(engine)
    saved_reduce, saved_backward = dist.all_reduce, engine.backward
    saved_step = engine.optimizer.optimizer.step
    saved_finish = engine.allreduce_gradients

    def all_reduce(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        k = _bucket_of(overlap, tensor) if overlap is not None else None
        name = f"b{k}" if k is not None else f"other{tensor.numel()}"
        events.append(f"launch:{name}:{'async' if kw.get('async_op') else 'sync'}")
        work = saved_reduce(tensor, *a, **kw)
        return _Handle(work, events, name) if kw.get("async_op") else work

    def backward(*a: Any, **kw: Any) -> Any:
        result = saved_backward(*a, **kw)
        events.append("micro_batch_backward_end")
        return result

    def finish(*a: Any, **kw: Any) -> Any:
        events.append("boundary_reduction")
        return saved_finish(*a, **kw)

    def optimizer_step(*a: Any, **kw: Any) -> Any:
        events.append("optimizer_step")
        return saved_step(*a, **kw)

    blocks = [m for m in engine.module.modules() if isinstance(m, TransformerBlock)]
    handles = [blk.register_full_backward_hook(lambda *_a, i=i: events.append(f"block{i}_backward_end"))
               for i, blk in enumerate(blocks)]
    dist.all_reduce, engine.backward, engine.allreduce_gradients = all_reduce, backward, finish
    engine.optimizer.optimizer.step = optimizer_step
    try:
        return original(self, step)
    finally:
        dist.all_reduce, engine.backward = saved_reduce, saved_backward
        engine.allreduce_gradients = saved_finish
        engine.optimizer.optimizer.step = saved_step
        for h in handles:
            h.remove()
        if overlap is not None:
            out["buckets"] = _layout(engine, overlap)


def train(argv: list[str]) -> dict[str, Any]:
    """Train ``argv`` on this rank; the traced step's events (see the module docstring) and the results."""
    import torch.distributed as dist
    from step_patch import train_with_step

    from megapost.optim.param_stats import owned_master
    from megapost.parallel import full_state_dict

    out: dict[str, Any] = {"events": [], "buckets": []}
    masters: dict[str, torch.Tensor] = {}

    def train_step(self: Any, original: Any, step: int) -> Any:
        result = original(self, step) if step != TRACED else _traced_step(self, step, original, out)
        masters.clear()  # after each step: Trainer.close() destroys the engine and its fp32 fragments
        for name, p in self.engine.module.named_parameters():
            if (m := owned_master(self.engine, p, self.pstate.tp_rank)) is not None:
                masters[name] = m.detach().clone()
        return result

    trainer, history = train_with_step(argv, train_step)
    engine, pstate = trainer.engine.ds, trainer.pstate
    steps = sorted(history["train_loss"])
    return {**out, "losses": [history["train_loss"][k] for k in steps],
            "grad_norms": [float(history["grad_norm"][k]) for k in steps],
            "weights": full_state_dict(engine.module, pstate), "masters": masters, "rank": dist.get_rank(),
            "optimizer": type(engine.optimizer).__name__, "zero_stage": engine.zero_optimization_stage()}


def train_both(argv: list[str]) -> dict[str, Any]:
    return {"plain": train([*argv, "--no-overlap-grad-reduce"]),
            "overlap": train([*argv, "--overlap-grad-reduce"])}


def run(data: Any, dp: int = 2, flags: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``train_both`` on ``dp`` gloo ranks: 4 layers, micro-batch 2, 4 micro-batches per step."""
    from dist_utils import run_ranks

    argv = ["--data-path", str(data.prefix), "--tokenizer-model", str(data.tokenizer_model),
            "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", str(8 * dp), "--train-iters", "4", "--log-interval", "1",
            "--eval-interval", "0", "--peak-tflops", "1", "--lr-warmup-iters", "1", "--seed", "7",
            "--bf16", "--zero-stage", "1", *flags]
    return run_ranks(train_both, dp, argv, timeout=900)
