"""Candidate layouts for a GPU count, which fit, and the fastest predicted one."""

from __future__ import annotations

from dataclasses import dataclass, field

from megapost.model import ModelConfig
from megapost.parallel.layout import layout_errors
from megapost.plan.counts import parameter_counts
from megapost.plan.memory import Layout, Precision, RankMemory, rank_memory


@dataclass
class Candidate:
    layout: Layout
    stages: list[RankMemory]
    peak: int  # the worst stage's per-rank peak, bytes
    fits: bool
    step_seconds: float
    tokens_per_second: float
    comm_bytes: float  # per GPU per step: TP all-reduces, PP sends, DP gradient reduction
    notes: list[str] = field(default_factory=list)

    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda m: m.peak)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def step_time(cfg: ModelConfig, layout: Layout, global_batch: int, peak_tflops: float, mfu: float) -> float:
    """Seconds per optimizer step: the step's model FLOPs (plus a block forward per checkpointed
    block) at ``mfu`` of ``peak_tflops`` on every GPU, stretched by the 1F1B bubble (pp-1)/m."""
    tokens = global_batch * cfg.seq_length
    flops = cfg.flops_per_token() * tokens
    if layout.checkpoint:  # recompute = the blocks' forward, a third of their training FLOPs
        flops += (cfg.flops_per_token() - 6.0 * cfg.hidden_size * cfg.vocab_size) / 3 * tokens
    seconds = flops / (layout.gpus * peak_tflops * 1e12 * mfu)
    return seconds * (1 + (layout.pp - 1) / layout.grad_accum)


def comm_bytes(cfg: ModelConfig, layout: Layout, global_batch: int, bf16: bool) -> float:
    """Per-GPU bytes sent per step, ring collectives (an all-reduce sends 2(n-1)/n of its buffer, a
    reduce-scatter or all-gather (n-1)/n): TP's four all-reduces (or SP's gather/scatter pairs) of
    [b, s, h] per block, forward and backward; PP's activations and gradients between stages; DP's
    gradient reduction (fp32 all-reduce under ZeRO-0/1, bf16 reduce-scatter under bf16 ZeRO-2) and,
    with ZeRO >= 1, the all-gather of updated weights."""
    lay, e = layout, 2 if bf16 else 4
    tokens_rank = global_batch // lay.dp * cfg.seq_length
    layers = cfg.num_layers / lay.pp
    tp = 4 * layers * tokens_rank * cfg.hidden_size * e * 2 * (lay.tp - 1) / lay.tp
    sent = 2 * tokens_rank * cfg.hidden_size * e / (lay.tp if lay.sequence_parallel else 1)
    pp = sent if lay.pp > 1 else 0.0
    params = parameter_counts(cfg).total / (lay.tp * lay.pp)
    ring = (lay.dp - 1) / lay.dp
    if lay.zero_stage == 2:
        dp = params * e * ring + params * e * ring
    else:
        dp = 2 * params * 4 * ring + (params * e * ring if lay.zero_stage == 1 else 0)
    return tp + pp + dp


def candidates(cfg: ModelConfig, gpus: int, global_batch: int, prec: Precision, *, gpus_per_node: int = 8,
               memory_bytes: float, margin: float = 0.10, peak_tflops: float = 989.0, mfu: float = 0.4,
               clip_grad: float = 1.0, micro_batches: list[int] | None = None,
               checkpoint_num_layers: int = 1) -> list[Candidate]:
    """Every layout megapost can run on ``gpus`` GPUs, with its memory and predicted speed."""
    out: list[Candidate] = []
    usable = memory_bytes * (1 - margin)
    for tp in [t for t in _divisors(gpus) if t <= min(8, gpus_per_node)]:
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
                    for ckpt in (False, True):
                        lay = Layout(tp, pp, dp, zero, mb, ga, ckpt, sp, checkpoint_num_layers)
                        stages = rank_memory(cfg, lay, prec)
                        peak = max(m.peak for m in stages)
                        t = step_time(cfg, lay, global_batch, peak_tflops, mfu)
                        out.append(Candidate(lay, stages, peak, peak <= usable, t,
                                             global_batch * cfg.seq_length / t,
                                             comm_bytes(cfg, lay, global_batch, prec.bf16)))
    return out


def recommend(cands: list[Candidate]) -> Candidate | None:
    """The fastest predicted layout that fits; ties go to less communication, then to the larger
    micro-batch (fewer, larger kernels), then to less memory."""
    fitting = sorted((c for c in cands if c.fits), key=rank_key)
    return fitting[0] if fitting else None


def rank_key(c: Candidate) -> tuple[float, float, int, int]:
    return (round(c.step_seconds, 6), round(c.comm_bytes, -3), -c.layout.micro_batch, c.peak)
