"""A tiny Llama trained with megapost.parallel.dist_optimizer on the gloo ranks of tests/dist_utils.run_ranks
(or one process), for tests/test_dist_optimizer.py: losses, final weights, the recorded issue order of
collectives against forward/backward compute, and checkpoint round trips."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import tiny_config

from megapost.model.llama import LlamaModel
from megapost.parallel.dist_optimizer import DistributedOptimizer

MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
             seq_length=16)
BUCKET = 6000  # elements: about one transformer block per bucket
MODEL_NOW: dict[str, Any] = {}  # overrides of MODEL for count_step (the benchmark's larger model)


def samples(step: int, count: int) -> torch.Tensor:
    """``count`` token rows of step ``step`` (the same on every rank and layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MODEL["vocab_size"], (count, MODEL["seq_length"] + 1), generator=g)


def decay_groups(groups: list[list[Any]]) -> list[dict[str, Any]]:
    """Megatron's (and megapost.optim.optimizer's) groups: weight decay 0.1, none on 1-D parameters."""
    return [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}]


def _no_decay(p: torch.nn.Parameter) -> int:
    return int(p.dim() < 2)


def build(bf16: bool = False, group: Any = None, bucket: int = BUCKET, clip: float = 0.0, trace: Any = None,
          reduce_dtype: torch.dtype = torch.float32, groups: bool = False
          ) -> tuple[LlamaModel, DistributedOptimizer]:
    model = LlamaModel(tiny_config(**{**MODEL, **MODEL_NOW}))
    if bf16:
        model = model.bfloat16()
    opt = DistributedOptimizer(list(model.parameters()),
                               lambda ps: torch.optim.AdamW(decay_groups(ps) if groups else ps, lr=1e-2,
                                                            weight_decay=0.1, foreach=False),
                               group, bucket_numel=bucket, clip_grad=clip, trace=trace,
                               reduce_dtype=reduce_dtype, group_of=_no_decay if groups else None)
    opt.install_forward_hooks(model.modules())
    return model, opt


def run_step(model: LlamaModel, opt: DistributedOptimizer, step: int, micro: int, group: Any = None,
             poison: bool = False) -> float:
    """One optimizer step: ``micro`` micro-batches of one row each on this rank (rows rank, rank+dp, ...
    of the step's dp x micro rows); returns the mean loss over every rank's micro-batches."""
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = samples(step, dp * micro)
    if MODEL_NOW:
        rows = torch.randint(0, MODEL_NOW["vocab_size"], (dp * micro, MODEL_NOW["seq_length"] + 1),
                             generator=torch.Generator().manual_seed(step))
    total = torch.zeros((), dtype=torch.float64)
    # poison: rank 0's gradient of the last vector parameter (the final norm's gain, inside one rank's
    # shard) becomes infinite, so one rank's reduced shard is finite and the other's is not
    gain = [p for p in model.parameters() if p.dim() == 1][-1]
    hook = gain.register_hook(lambda g: g * float("inf")) if poison and rank == 0 else None
    for j in range(micro):
        tokens = rows[j * dp + rank].unsqueeze(0)
        opt.start_micro_batch(last=j == micro - 1)
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        (loss / micro).backward()
        total += loss.detach().double()
    if hook is not None:
        hook.remove()
    dist.all_reduce(total, group=group)
    opt.step()
    return float(total) / (dp * micro)


def train(steps: int, micro: int, bf16: bool = False, clip: float = 0.0, bucket: int = BUCKET,
          poison_step: int = 0, reduce_dtype: torch.dtype = torch.float32, groups: bool = False
          ) -> dict[str, Any]:
    """Losses and the final weights of ``steps`` steps on this rank's data-parallel world (``groups``: no
    weight decay on 1-D parameters), with the layout-free Adam moments."""
    torch.manual_seed(0)
    model, opt = build(bf16, bucket=bucket, clip=clip, reduce_dtype=reduce_dtype, groups=groups)
    losses, skipped = [], []
    for s in range(1, steps + 1):
        losses.append(run_step(model, opt, s, micro, poison=s == poison_step))
        skipped.append(bool(opt.skipped))
    opt.finish_param_sync()
    return {"losses": losses, "skipped": skipped, "params": {k: v.detach().float().clone()
                                                        for k, v in model.state_dict().items()},
            "exp_avg": opt.full_state()["exp_avg"]}


def train_plain(steps: int, micro: int, groups: bool = False) -> dict[str, Any]:
    """The fp32 reference without megapost: one process, torch's AdamW on the model's parameters,
    ``micro`` micro-batches of one row per step, gradients accumulated in ``.grad`` (``groups``: no
    weight decay on 1-D parameters)."""
    torch.manual_seed(0)
    model = LlamaModel(tiny_config(**MODEL))
    params = list(model.parameters())
    split = [[p for p in params if not _no_decay(p)], [p for p in params if _no_decay(p)]]
    opt = torch.optim.AdamW(decay_groups(split) if groups else params, lr=1e-2, weight_decay=0.1,
                            foreach=False)
    losses = []
    for step in range(1, steps + 1):
        total = 0.0
        for tokens in samples(step, micro):
            logits = model(tokens[None, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[None, 1:].reshape(-1))
            (loss / micro).backward()
            total += float(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / micro)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in params]}


def reshard(steps: int) -> dict[str, Any]:
    """``steps`` steps at DP 2 (one micro-batch), the layout-free state saved, then ``steps`` more two
    ways: on at DP 2, and on rank 0 alone (DP 1, two micro-batches, other buckets) from the saved state."""
    torch.manual_seed(0)
    model, opt = build()
    for s in range(1, steps + 1):
        run_step(model, opt, s, 1)
    state = opt.full_state()
    on = [run_step(model, opt, s, 1) for s in range(steps + 1, 2 * steps + 1)]
    alone = dist.new_group([0])
    out: dict[str, Any] = {"dp2": on}
    if dist.get_rank() == 0:
        model1, opt1 = build(group=alone, bucket=BUCKET // 3)
        opt1.load_full_state(state)
        out["dp1"] = [run_step(model1, opt1, s, 2, group=alone) for s in range(steps + 1, 2 * steps + 1)]
    dist.barrier()
    return out


def record_compute(model: torch.nn.Module, events: list[str]) -> dict[torch.nn.Module, str]:
    """Append "forward start/end NAME" and "grad NAME" (as its gradient is accumulated) to ``events`` for
    each module with parameters of its own; returns those modules' names."""
    names = {m: n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    for m, n in names.items():
        m.register_forward_pre_hook(lambda _m, _a, n=n: events.append(f"forward start {n}"))
        m.register_forward_hook(lambda _m, _a, _o, n=n: events.append(f"forward end {n}"))
        for p in m.parameters(recurse=False):
            p.register_post_accumulate_grad_hook(lambda _p, n=n: events.append(f"grad {n}"))
    return names


def trace_step(bf16: bool = True) -> dict[str, Any]:
    """Events of optimizer step 2 (after step 1 updated the weights): collective issues from the
    optimizer, and each parameterised leaf module's forward start/end and first gradient."""
    events: list[str] = []
    torch.manual_seed(0)
    model, opt = build(bf16, trace=events.append)
    names = record_compute(model, events)
    run_step(model, opt, 1, 2)
    events.clear()
    run_step(model, opt, 2, 2)
    buckets = [sorted({names[m] for m in names for p in m.parameters(recurse=False)
                       if any(p is q for q in b.params)}) for b in opt.buckets]
    return {"events": list(events), "buckets": buckets}


def count_step(micro_batches: list[int], bf16: bool, model: dict[str, Any] | None = None,
               bucket: int = BUCKET) -> list[dict[str, Any]]:
    """Per micro-batch count: the wire bytes (tests/comm_count) of optimizer step 2 of the distributed
    optimizer on this rank's data-parallel world, by collective, with the model's parameter count."""
    from comm_count import COUNTS

    out = []
    for micro in micro_batches:
        MODEL_NOW.update(model or {})
        torch.manual_seed(0)
        m, opt = build(bf16, bucket=bucket)
        run_step(m, opt, 1, micro)
        for d in (COUNTS.payload, COUNTS.wire, COUNTS.calls):
            d.clear()
        COUNTS.enabled = True
        run_step(m, opt, 2, micro)
        COUNTS.enabled = False
        out.append({"micro_batches": micro, "wire": dict(COUNTS.wire), "calls": dict(COUNTS.calls),
                    "params": sum(p.numel() for p in m.parameters()), "buckets": len(opt.buckets)})
        MODEL_NOW.clear()
    return out


def train_tp(steps: int, micro: int, tp: int, count: bool = False, defer: bool = False,
             clip: float = 0.0) -> dict[str, Any]:
    """``steps`` steps of megapost's tensor-parallel model (TP ``tp`` + SP, no DeepSpeed engine) with the
    distributed optimizer over the data-parallel group, the norm also over the TP group (replicated
    parameters counted once); losses, the tensor-parallel all-reduces of step 2 (megapost's own
    collectives), the optimizer's events and with ``count`` the wire bytes of step 2 by group axis.
    ``defer``: the sequence-parallel gains summed once per step by the optimizer, not per micro-batch."""
    from comm_count import COUNTS, _by_axis

    from megapost.parallel import build_model, initialize_parallel, make_loss_fn
    from megapost.parallel.collectives import CommStats, counting_comm
    from megapost.parallel.layers import defer_sequence_parallel_reduction

    pstate = initialize_parallel(tp, 1, sequence_parallel=True)
    model, _ = build_model(tiny_config(**MODEL), pstate)
    loss_fn = make_loss_fn(pstate)
    deferred = defer_sequence_parallel_reduction(model) if defer else []
    events: list[str] = []
    opt = DistributedOptimizer(
        list(model.parameters()), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
        pstate.dp_group, bucket_numel=BUCKET, norm_groups=[pstate.tp_group], clip_grad=clip,
        norm_weight=lambda p: 1.0 if getattr(p, "tensor_model_parallel", False) else 1.0 / tp,
        partial_sums=(pstate.tp_group, deferred) if defer else None, trace=events.append)
    opt.install_forward_hooks(model.modules())
    losses, by_axis, tp_calls, step_events = [], {}, 0, []
    for step in range(1, steps + 1):
        dp, rank = pstate.dp_size, pstate.dp_rank
        rows = samples(step, dp * micro)
        total = torch.zeros((), dtype=torch.float64)
        COUNTS.enabled = count and step == 2
        events.clear()
        with counting_comm(CommStats()) as comm:
            comm.enabled = step == 2
            for j in range(micro):
                tokens = rows[j * dp + rank].unsqueeze(0)
                opt.start_micro_batch(last=j == micro - 1)
                labels = tokens[:, 1:]
                loss = loss_fn(model(tokens[:, :-1]), labels, torch.ones_like(labels, dtype=torch.float))
                (loss / micro).backward()
                total += loss.detach().double()
            dist.all_reduce(total, group=pstate.dp_group)
            opt.step()
        COUNTS.enabled = False
        if step == 2:
            tp_calls = comm.calls.get("all_reduce", 0)
            step_events = list(events)
        losses.append(float(total) / (dp * micro))
        if count and step == 2:
            by_axis = _by_axis(pstate)
    return {"losses": losses, "by_axis": by_axis, "params": sum(p.numel() for p in model.parameters()),
            "tp_all_reduces": tp_calls, "deferred": len(deferred), "events": step_events}
