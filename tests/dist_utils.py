"""Multi-rank test harness: launch N gloo ranks running a function, and the layout driver that trains
one (TP, PP, DP) layout through megapost's own build path (megapost.train.build) on a synthetic corpus.

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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megapost.model import ModelConfig, TransformerBlock, set_listener
from megapost.plugin_api import Plugin


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

        from megapost.runtime.distributed import skip_cpu_shm_op_build

        ds_logging.logger.setLevel("WARNING")
        skip_cpu_shm_op_build()  # as megapost's own start-up does: no ~1 min C++ build of an unused op
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
    count_comm: bool = False  # time steps, count tensor-parallel collective bytes from step 2 (1 warms up)
    z_loss: float = 0.0  # PaLM's z-loss coefficient (build_model's loss function)
    flags: tuple[str, ...] = ()  # more megapost-pretrain flags (e.g. --use-distributed-optimizer, --bf16)


def synthetic_micro_batch(spec: RunSpec, cfg: ModelConfig, step: int, index: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A standalone micro-batch (unit tests outside the trainer): tokens, labels, ~15%-zero loss mask."""
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


def write_token_stream(prefix: str, spec: RunSpec, cfg: ModelConfig) -> None:
    """``spec``'s synthetic corpus as a Megatron .bin/.idx (megapost's builder): documents of random
    lengths (seq/2 .. 3 seq) of random ids below vocab - 16, enough for one epoch of the run."""
    from megapost.data import IndexedDatasetBuilder, best_dtype

    gen = torch.Generator().manual_seed(spec.data_seed)
    need = (spec.steps * spec.global_batch + 2) * (cfg.seq_length + 1)
    with IndexedDatasetBuilder(prefix, best_dtype(cfg.vocab_size)) as builder:
        total = 0
        while total < need:
            length = int(torch.randint(cfg.seq_length // 2, 3 * cfg.seq_length, (1,), generator=gen))
            builder.add_document(torch.randint(0, cfg.vocab_size - 16, (length,), generator=gen).tolist())
            total += length


def _model_flags(cfg: ModelConfig) -> list[str]:
    flags = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size, "--ffn-hidden-size",
             cfg.ffn_hidden_size, "--num-attention-heads", cfg.num_attention_heads, "--seq-length",
             cfg.seq_length, "--norm-position", cfg.norm_position,
             "--mix-post-fraction", cfg.mix_post_fraction,
             "--dyt-alpha-init", ",".join(map(str, cfg.dyt_alpha_init)), "--norm-eps", cfg.norm_eps,
             "--rope-theta", cfg.rope_theta, "--init-variance", cfg.init_variance, "--init-method-std",
             cfg.init_method_std, "--init-sublayer-multiplier", cfg.sublayer_init_multiplier,
             "--prefix-alpha", cfg.prefix_alpha, "--seed", cfg.seed,
             "--tokenizer-type", "NullTokenizer", "--vocab-size", cfg.vocab_size,
             "--make-vocab-size-divisible-by", 1]
    flags += ["--num-query-groups", cfg.num_query_groups] if cfg.num_query_groups else []
    flags += ["--qk-norm"] if cfg.qk_norm else []
    flags += [] if cfg.scaled_output_init else ["--no-scaled-output-init"]
    return [str(f) for f in flags]


def layout_argv(spec: RunSpec, cfg: ModelConfig, data_prefix: str) -> list[str]:
    """megapost-pretrain's flags for ``spec``: constant lr, no evaluation or checkpoints."""
    flags = [*_model_flags(cfg), "--data-path", data_prefix, "--split", "1,0,0",
             "--micro-batch-size", spec.micro_batch, "--global-batch-size", spec.global_batch,
             "--train-iters", spec.steps, "--lr", spec.lr, "--lr-decay-style", "constant",
             "--clip-grad", spec.clip, "--zero-stage", spec.zero_stage, "--z-loss", spec.z_loss,
             "--optimizer", "sgd" if spec.optimizer == "sgd" else "adam", "--sgd-momentum", 0,
             "--tensor-model-parallel-size", spec.tp, "--pipeline-model-parallel-size", spec.pp,
             "--eval-interval", 0, "--log-interval", spec.steps, "--peak-tflops", 1]
    flags += ["--sequence-parallel"] if spec.sp else []
    flags += ["--checkpoint-activations"] if spec.checkpoint_activations else []
    return [str(f) for f in [*flags, *spec.flags]]


class StepClock(Plugin):
    """Times every step from 1 on and counts tensor-parallel bytes from step 2 on (step 1 warms up)."""

    name = "step_clock"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.times: list[float] = []
        self._start = 0.0

    def wants_step(self, step: int) -> bool:
        return step >= 1

    def on_step_begin(self, step: int, model: Any) -> None:
        from megapost.parallel.collectives import active_counter

        active_counter().enabled = step > 1  # train_layout's counting block
        self._start = time.perf_counter()

    def on_step_end(self, step: int, loss: float) -> None:
        from megapost.parallel.collectives import active_counter

        self.times.append(time.perf_counter() - self._start)
        active_counter().enabled = False


def train_layout(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` on this rank through megapost's own build path and Trainer (call on every rank via
    ``run_ranks``): its data written as a .bin/.idx and read by megapost's data path, its generated
    DeepSpeed config, engine hooks and optimizer (fused AdamW, or SGD).

    Returns per-step losses (mean over the global batch) and global gradient norms, step times (with
    ``count_comm``), the probe counts, and on global rank 0 the full-model parameters before and after.
    """
    import shutil

    import torch.distributed as dist

    from megapost.parallel import full_state_dict
    from megapost.parallel.collectives import CommStats, counting_comm
    from megapost.train.build import build
    from megapost.train.prepare import Prepared, prepare

    cfg = tiny_config(**spec.model)
    tmp = [tempfile.mkdtemp(prefix="megapost-layout-") if dist.get_rank() == 0 else None]
    if tmp[0] is not None:
        write_token_stream(os.path.join(tmp[0], "tokens"), spec, cfg)
    dist.broadcast_object_list(tmp, src=0)
    prep = prepare(layout_argv(spec, cfg, os.path.join(tmp[0], "tokens")), dist.get_world_size())
    if spec.count_comm:
        prep = Prepared(prep.args, prep.model, prep.user_ds, [StepClock])
    trainer = build(prep)
    model, pstate = trainer.engine.module, trainer.pstate
    counter = ProbeCounter()
    if spec.probes:
        set_listener(model, counter)
    params0 = full_state_dict(model, pstate) if spec.return_params else None
    stats = CommStats()
    try:
        with counting_comm(stats):
            stats.enabled = False  # StepClock (count_comm) counts from step 2 on
            history = trainer.train()
    finally:
        trainer.close()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
    if spec.probes:
        set_listener(model, None)
    params = full_state_dict(model, pstate) if spec.return_params else None
    steps = sorted(history["train_loss"])
    return {
        "rank": dist.get_rank(), "coord": (pstate.tp_rank, pstate.pp_rank, pstate.dp_rank),
        "losses": [history["train_loss"][k] for k in steps],
        "grad_norms": [history["grad_norm"][k] for k in steps],
        "step_times": trainer.plugins[0].times if spec.count_comm else [], "gas": prep.args.grad_accum_steps,
        "probe_forward": dict(counter.forward), "probe_backward": dict(counter.backward),
        "tp_bytes": dict(stats.bytes), "tp_calls": dict(stats.calls),
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


def check_layouts_match_single_process(specs: list[RunSpec], dp: int, slack: Sequence[float] = ()) -> None:
    """``check_layout_matches_single_process`` for several models of one layout, in two launches."""
    slack = slack or [1.0] * len(specs)  # compare_with_single_process's, per spec
    for spec, ref, ranks, s in zip(specs, references(specs), run_layouts(specs, dp), slack, strict=True):
        compare_with_single_process(spec, dp, ref, ranks, s)


def compare_with_single_process(spec: RunSpec, dp: int, ref: dict[str, Any], ranks: list[dict[str, Any]],
                                slack: float = 1.0) -> None:
    """The assertions of ``check_layout_matches_single_process`` on finished runs; ``slack`` multiplies
    the gradient-norm and weight tolerances (a case whose equivalent single-process runs disagree more)."""
    out, sgd = ranks[0], spec.optimizer == "sgd"
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
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5 * slack, diffs
    first = max_rel_diff(out["grad_norms"][:1], ref["grad_norms"][:1])  # before any reordering grows
    assert slack == 1.0 or first <= 1e-6, f"first-step grad norm differs by {first:.2e}:{model}"
    assert diffs["param_rel_update"] <= (1e-5 if sgd else 1e-4) * slack, diffs
    assert diffs["param_abs"] <= (1e-6 if sgd else 1e-4) * slack, diffs
    for r in ranks if spec.probes else ():  # every probe once per micro-batch, checkpointed or not, dL/dY too
        assert set(r["probe_forward"].values()) == {spec.steps * out["gas"]}, r["probe_forward"]
        assert set(r["probe_backward"].values()) == {spec.steps * out["gas"]}, r["probe_backward"]
