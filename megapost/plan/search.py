"""Candidate layouts for a GPU count, which fit, and the fastest predicted one."""

from __future__ import annotations

from dataclasses import dataclass, field

from megapost.model import ModelConfig
from megapost.parallel.layout import layout_errors
from megapost.parallel.reduce_bytes import dist_optimizer_bytes, dp_step_bytes
from megapost.plan.counts import stage_parameters
from megapost.plan.memory import Layout, Precision, RankMemory, rank_memory
from megapost.plan.throughput import Cluster, step_parts


@dataclass
class Candidate:
    layout: Layout
    stages: list[RankMemory]
    peak: int  # the worst stage's per-rank peak, bytes
    fits: bool
    step_seconds: float
    tokens_per_second: float
    comm_bytes: float  # per GPU per step: TP all-reduces, PP sends, DP gradient reduction
    time_parts: dict[str, float] = field(default_factory=dict)  # seconds by cause (plan.throughput)
    notes: list[str] = field(default_factory=list)

    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda m: m.peak)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def comm_bytes(cfg: ModelConfig, layout: Layout, global_batch: int, bf16: bool,
               reduce_in_bf16: bool = False) -> float:
    """Per-GPU bytes sent per step, ring collectives (an all-reduce sends 2(n-1)/n of its buffer, a
    reduce-scatter or all-gather (n-1)/n): TP's four all-reduces (or SP's gather/scatter pairs) of
    [b, s, h] per block, forward and backward; PP's activations and gradients between stages; DP's
    gradient reduction and weight all-gather on the most loaded stage, as DeepSpeed does it per ZeRO
    stage (megapost.parallel.reduce_bytes: once per step at ZeRO-0/1, every micro-batch at ZeRO-2)."""
    return sum(comm_parts(cfg, layout, global_batch, bf16, reduce_in_bf16).values())


def comm_parts(cfg: ModelConfig, layout: Layout, global_batch: int, bf16: bool,
               reduce_in_bf16: bool = False) -> dict[str, float]:
    """``comm_bytes`` by parallelism: {"tp", "pp", "dp"}."""
    lay, e = layout, 2 if bf16 else 4
    tokens_rank = global_batch // lay.dp * cfg.seq_length
    layers = cfg.num_layers / lay.pp
    tp = 4 * layers * tokens_rank * cfg.hidden_size * e * 2 * (lay.tp - 1) / lay.tp
    sent = 2 * tokens_rank * cfg.hidden_size * e / (lay.tp if lay.sequence_parallel else 1)
    pp = sent * lay.virtual if lay.pp > 1 else 0.0  # interleaved: every chunk boundary crosses ranks
    params = max(stage_parameters(cfg, lay.tp, lay.pp, s) for s in range(lay.pp))
    dp = (dist_optimizer_bytes(params, lay.dp, bf16, reduce_in_bf16) if lay.distributed_optimizer else
          dp_step_bytes(params, lay.dp, lay.zero_stage, lay.grad_accum, bf16, reduce_in_bf16)).total
    return {"tp": tp, "pp": pp, "dp": dp}


def candidates(cfg: ModelConfig, gpus: int, global_batch: int, prec: Precision, *, memory_bytes: float,
               cluster: Cluster | None = None, margin: float = 0.10, clip_grad: float = 1.0,
               micro_batches: list[int] | None = None, checkpoint_num_layers: int = 1,
               reduce_in_bf16: bool = False, distributed_optimizer: bool = False,
               tp_overlap: bool = True) -> list[Candidate]:
    """Every layout megapost can run on ``gpus`` GPUs, with its memory and predicted speed; with
    ``distributed_optimizer`` ZeRO-1 at DP > 1 is megapost's distributed optimizer (the native engine of
    ``--use-distributed-optimizer``, megapost.native; the CLI keeps its layouts at PP 1); ``tp_overlap``
    False: --no-async-tensor-model-parallel-allreduce."""
    out: list[Candidate] = []
    cluster = cluster or Cluster()
    usable = memory_bytes * (1 - margin)
    for tp in [t for t in _divisors(gpus) if t <= min(8, cluster.gpus_per_node)]:
        for pp in [p for p in _divisors(gpus // tp) if p <= cfg.num_layers]:
            dp = gpus // (tp * pp)
            sp = tp > 1
            if layout_errors(cfg, tp, pp, sp and cfg.seq_length % tp == 0, cfg.seq_length, gpus):
                continue
            sp = sp and cfg.seq_length % tp == 0
            for mb in micro_batches or [1, 2, 4, 8, 16]:
                if global_batch % (mb * dp):
                    continue
                ga = global_batch // (mb * dp)
                for zero in (0, 1, 2):
                    if (pp > 1 and zero >= 2) or (prec.bf16 and zero == 0):
                        continue  # megapost: PP needs ZeRO <= 1; bf16 promotes ZeRO-0 to 1
                    if pp > 1 and zero == 0 and not prec.bf16 and clip_grad > 0:
                        continue  # fp32 PP + clipping needs ZeRO-1 (deepspeed_config_errors)
                    native = distributed_optimizer and zero == 1 and dp > 1
                    for ckpt, v in ((c, v) for c in (False, True) for v in _virtual(cfg, pp, ga, native)):
                        lay = Layout(tp, pp, dp, zero, mb, ga, ckpt, sp, checkpoint_num_layers, native, v,
                                     tp_overlap=tp_overlap)
                        stages = rank_memory(cfg, lay, prec)
                        peak = max(m.peak for m in stages)
                        comm = comm_parts(cfg, lay, global_batch, prec.bf16, reduce_in_bf16)
                        parts = step_parts(cfg, lay, global_batch, prec.bf16, cluster, comm)
                        t = sum(parts.values())
                        out.append(Candidate(lay, stages, peak, peak <= usable, t,
                                             global_batch * cfg.seq_length / t, sum(comm.values()), parts))
    return out


def _virtual(cfg: ModelConfig, pp: int, micro_batches: int, native: bool) -> list[int]:
    """Chunks per pipeline rank a layout may run: 1, and on the native engine at PP > 1 the interleaved
    schedule's 2 and 4 where the layers split evenly and the micro-batches make equal rounds
    (megapost.native.build.refusals)."""
    if not native or pp == 1 or micro_batches % max(1, micro_batches // pp):
        return [1]
    return [1, *(v for v in (2, 4) if cfg.num_layers % (pp * v) == 0)]


def recommend(cands: list[Candidate]) -> Candidate | None:
    """The fastest predicted layout that fits; ties go to less communication, then to the larger
    micro-batch (fewer, larger kernels), then to less memory."""
    fitting = sorted((c for c in cands if c.fits), key=rank_key)
    return fitting[0] if fitting else None


def rank_key(c: Candidate) -> tuple[float, float, int, int]:
    return (round(c.step_seconds, 6), round(c.comm_bytes, -3), -c.layout.micro_batch, c.peak)
