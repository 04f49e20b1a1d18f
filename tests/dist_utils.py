"""Multi-rank test harness: launch N gloo ranks running a function, and a small DeepSpeed training
driver that runs one (TP, PP, DP) layout on synthetic data.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), sets the torchrun
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT on a free port), one OMP thread each,
``deepspeed.init_distributed("gloo")``, calls ``fn(*args)`` and returns every rank's return value
(sent back through files with ``torch.save``). A failing rank's traceback is raised in the caller.
``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megapost.model import ModelConfig, TransformerBlock, set_listener


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple,
               setup: Callable[[], None] | None) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    try:
        if setup is not None:
            setup()
        import deepspeed
        import deepspeed.utils.logging as ds_logging

        ds_logging.logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                   timeout=timedelta(seconds=180))
        result = fn(*args)
        torch.save({"result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"error": traceback.format_exc()}, path)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
              setup: Callable[[], None] | None = None) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks; the list of their return values, by rank. ``setup()``
    runs first in each rank, before DeepSpeed is imported and the process group initialised."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megapost-ranks-") as out:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, out, fn, args, setup))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        results, errors = [], []
        for r in range(world_size):
            path = Path(out) / f"rank{r}.pt"
            if not path.exists():
                why = "timed out" if r in hung else f"exit code {procs[r].exitcode}"
                errors.append(f"rank {r}: no result ({why})")
                results.append(None)
                continue
            payload = torch.load(path, weights_only=False)
            if "error" in payload:
                errors.append(f"rank {r}:\n{payload['error']}")
            results.append(payload.get("result"))
        if errors:
            raise RuntimeError("distributed run failed\n" + "\n".join(errors))
        return results


# ----------------------------------------------------------------------------- training driver


def tiny_config(**overrides: Any) -> ModelConfig:
    """4 layers, d=64, 4 heads, ffn 128, vocab 256, seq 32."""
    base = dict(vocab_size=256, num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                seq_length=32, norm_position="post", seed=1234)
    return ModelConfig(**{**base, **overrides})


@dataclass(frozen=True)
class RunSpec:
    """One training run: layout, schedule and model."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    steps: int = 10
    global_batch: int = 8
    micro_batch: int = 2
    zero_stage: int = 1
    lr: float = 2e-3
    clip: float = 1.0
    checkpoint_activations: bool = False
    probes: bool = False  # attach a counting listener that also hooks dL/dY
    model: dict[str, Any] = field(default_factory=dict)  # tiny_config overrides
    return_params: bool = True
    data_seed: int = 7
    optimizer: str = "adamw"  # or "sgd" (no momentum: parameter differences are lr x gradient differences)
    count_comm: bool = False  # count tensor-parallel collective bytes over steps 1.. (step 0 warms up)
    z_loss: float = 0.0  # PaLM's z-loss coefficient (build_model's loss function)


def synthetic_micro_batch(spec: RunSpec, cfg: ModelConfig, step: int, index: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of optimizer step ``step``: tokens, next-token labels, and a loss
    mask with ~15% zeros. Tokens avoid the top 16 ids (as padding rows of a vocab would be unused)."""
    gen = torch.Generator().manual_seed(spec.data_seed * 1_000_003 + step * 1009 + index)
    seq = torch.randint(0, cfg.vocab_size - 16, (spec.micro_batch, cfg.seq_length + 1), generator=gen)
    mask = (torch.rand(spec.micro_batch, cfg.seq_length, generator=gen) > 0.15).float()
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), mask


class ProbeCounter:
    """Counts listener calls per probe and backward calls of the dL/dY hooks it registers."""

    def __init__(self) -> None:
        self.forward: dict[str, int] = defaultdict(int)
        self.backward: dict[str, int] = defaultdict(int)

    def __call__(self, name: tuple, **tensors: torch.Tensor | None) -> None:
        key = "/".join(map(str, name))
        self.forward[key] += 1
        y = tensors.get("y")
        if y is not None and y.requires_grad:
            y.register_hook(lambda g, key=key: self.backward.__setitem__(key, self.backward[key] + 1))


def deepspeed_config(spec: RunSpec, dp: int) -> dict[str, Any]:
    return {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.global_batch // (spec.micro_batch * dp),
        "gradient_clipping": spec.clip,
        "zero_optimization": {"stage": spec.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def train_layout(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` on this rank through the DeepSpeed engine (call on every rank via ``run_ranks``).

    Returns per-step losses (mean over the global batch) and global gradient norms, step times, the
    probe counts, and on global rank 0 the full-model parameters after the last step.
    """
    import deepspeed
    import torch.distributed as dist

    from megapost.parallel import (
        build_model,
        deepspeed_config_overrides,
        full_state_dict,
        initialize_parallel,
        make_mpu,
    )
    from megapost.parallel.collectives import COMM_STATS

    pstate = initialize_parallel(spec.tp, spec.pp, spec.sp)
    cfg = tiny_config(**spec.model)
    model, loss_fn = build_model(cfg, pstate, checkpoint_activations=spec.checkpoint_activations,
                                 z_loss=spec.z_loss)
    counter = ProbeCounter()
    if spec.probes:
        set_listener(model, counter)
    params0 = full_state_dict(model, pstate) if spec.return_params else None
    if spec.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, foreach=False)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1, foreach=False)
    config = deepspeed_config(spec, pstate.dp_size) | deepspeed_config_overrides(pstate)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      mpu=make_mpu(pstate) if pstate.pp_size == 1 else None)
    gas = engine.gradient_accumulation_steps()
    losses, norms, times = [], [], []
    COMM_STATS.reset()
    for step in range(spec.steps):
        COMM_STATS.enabled = spec.count_comm and step > 0
        batches = [synthetic_micro_batch(spec, cfg, step, pstate.dp_rank * gas + i) for i in range(gas)]
        start = time.perf_counter()
        if pstate.pp_size > 1:
            loss = float(engine.train_batch(iter([((t,), (lab, m)) for t, lab, m in batches])))
        else:
            total = torch.zeros(())
            for tokens, labels, mask in batches:
                micro_loss = loss_fn(engine(tokens), labels, mask)
                engine.backward(micro_loss)
                engine.step()
                total += micro_loss.detach()
            total /= gas
            if pstate.dp_size > 1:
                dist.all_reduce(total, group=pstate.dp_group)
                total /= pstate.dp_size
            loss = float(total)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    COMM_STATS.enabled = False
    if spec.probes:
        set_listener(model, None)
    params = full_state_dict(model, pstate) if spec.return_params else None
    return {
        "rank": dist.get_rank(), "coord": (pstate.tp_rank, pstate.pp_rank, pstate.dp_rank),
        "losses": losses, "grad_norms": norms, "step_times": times, "gas": gas,
        "probe_forward": dict(counter.forward), "probe_backward": dict(counter.backward),
        "tp_bytes": dict(COMM_STATS.bytes), "tp_calls": dict(COMM_STATS.calls),
        "local_layers": sum(isinstance(m, TransformerBlock) for m in model.modules()),
        "local_params": sum(p.numel() for p in model.parameters()),
        "first_stage": pstate.is_first_stage, "last_stage": pstate.is_last_stage,
        "params": params if dist.get_rank() == 0 else None,
        "params0": params0 if dist.get_rank() == 0 else None,
        "spec": asdict(spec),
    }


def run_layout(spec: RunSpec, dp: int = 1, timeout: float = 600.0) -> list[dict[str, Any]]:
    """``train_layout(spec)`` on tp * pp * dp ranks."""
    return run_ranks(train_layout, spec.tp * spec.pp * dp, spec, timeout=timeout)


def train_layouts(specs: list[RunSpec]) -> list[dict[str, Any]]:
    """``train_layout`` of each spec in turn, in one process group (one launch for many models)."""
    return [train_layout(spec) for spec in specs]


def run_layouts(specs: list[RunSpec], dp: int = 1,
                timeout: float | None = None) -> list[list[dict[str, Any]]]:
    """Every spec (all of one tp x pp) on tp * pp * dp ranks in one launch: results[spec][rank].
    ``timeout`` defaults to 300 s + 120 s per spec (generous: other jobs share the cores)."""
    worlds = {spec.tp * spec.pp * dp for spec in specs}
    assert len(worlds) == 1, "one launch runs one world size"
    timeout = 300.0 + 120.0 * len(specs) if timeout is None else timeout
    by_rank = run_ranks(train_layouts, worlds.pop(), specs, timeout=timeout)
    return [list(ranks) for ranks in zip(*by_rank, strict=True)]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise |a - b| over all parameters."""
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def relative_update_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                         start: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b - start|| over all parameters: the disagreement of two runs relative to how far
    training moved the weights (insensitive to the few elements where Adam's update g/(|g|+eps)
    amplifies last-bit gradient differences because |g| is near eps)."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float((b[k] - start[k]).double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


# ----------------------------------------------------------------------------- layout vs single process

_references: dict[str, dict[str, Any]] = {}


def _single_process(spec: RunSpec) -> RunSpec:
    return replace(spec, tp=1, pp=1, sp=False, checkpoint_activations=False, probes=False)


def reference(spec: RunSpec) -> dict[str, Any]:
    """The single-process run of ``spec``'s model, data and optimizer (cached per session)."""
    key = _single_process(spec)
    if repr(key) not in _references:
        _references[repr(key)] = run_layout(key)[0]
    return _references[repr(key)]


def references(specs: list[RunSpec]) -> list[dict[str, Any]]:
    """``reference`` of each spec; the missing ones computed in one single-process launch."""
    missing = list({repr(k): k for k in map(_single_process, specs) if repr(k) not in _references}.values())
    if missing:
        for key, ranks in zip(missing, run_layouts(missing), strict=True):
            _references[repr(key)] = ranks[0]
    return [_references[repr(_single_process(spec))] for spec in specs]


def check_layout_matches_single_process(spec: RunSpec, dp: int) -> None:
    """``spec`` on tp x pp x dp ranks trains like one process (tolerances: tests/test_parallel_layouts.py):
    identical initial weights, per-step losses and global gradient norms within 1e-5 relative, weights
    after training within 1e-5 (SGD) / 1e-4 (AdamW) of the distance trained; probes once per micro-batch."""
    compare_with_single_process(spec, dp, reference(spec), run_layout(spec, dp))


def check_layouts_match_single_process(specs: list[RunSpec], dp: int) -> None:
    """``check_layout_matches_single_process`` for several models of one layout, in two launches."""
    refs = references(specs)
    for spec, ref, ranks in zip(specs, refs, run_layouts(specs, dp), strict=True):
        compare_with_single_process(spec, dp, ref, ranks)


def compare_with_single_process(spec: RunSpec, dp: int, ref: dict[str, Any], ranks: list[dict[str, Any]]
                                ) -> None:
    """The assertions of ``check_layout_matches_single_process`` on finished runs."""
    out = ranks[0]
    sgd = spec.optimizer == "sgd"
    diffs = {
        "loss": max_rel_diff(out["losses"], ref["losses"]),
        "grad_norm": max_rel_diff(out["grad_norms"], ref["grad_norms"]) if ref["grad_norms"][0] else 0.0,
        "param_abs": max_param_diff(out["params"], ref["params"]),
        "param_rel_update": relative_update_diff(out["params"], ref["params"], ref["params0"]),
    }
    model = "".join(f" {k}={v}" for k, v in {**spec.model, "z_loss": spec.z_loss}.items() if v)
    print(f"\n{spec.tp}x{spec.pp}x{dp} sp={spec.sp} {spec.optimizer} zero{spec.zero_stage}{model}: "
          + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    diffs["model"] = model
    assert max_param_diff(out["params0"], ref["params0"]) == 0.0, f"initial weights differ by layout:{model}"
    assert all(r["losses"] == out["losses"] for r in ranks), f"ranks disagree on the loss:{model}"
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5, diffs
    assert diffs["param_rel_update"] <= (1e-5 if sgd else 1e-4), diffs
    assert diffs["param_abs"] <= (1e-6 if sgd else 1e-4), diffs
    if spec.probes:  # every probe reported once per micro-batch, checkpointed or not, and its dL/dY hook ran
        micro_batches = spec.steps * out["gas"]
        for r in ranks:
            assert set(r["probe_forward"].values()) == {micro_batches}, r["probe_forward"]
            assert set(r["probe_backward"].values()) == {micro_batches}, r["probe_backward"]
