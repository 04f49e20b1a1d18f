"""The planner's speed model: seconds per optimizer step of a layout, from its compute at a micro-batch
dependent MFU, its pipeline bubble, and the communication it cannot hide (docs/scaling.md).

    step = compute * (1 + (pp - 1) / (m * v)) + exposed communication

- compute: the step's model FLOPs (plus a block forward per checkpointed block) / (GPUs * peak *
  MFU(T)), where MFU saturates in the tokens of a micro-batch, T = b * s:
  MFU(T) = mfu * T / (T + T_half) (``--mfu`` is the saturated value; ``--mfu-half-tokens`` T_half, the
  micro-batch at which half of it is reached: small GEMMs leave a GPU idle);
- the 1F1B bubble (pp - 1) / m, m micro-batches per step; under the interleaved schedule (v chunks per
  pipeline rank, the native engine's --num-layers-per-virtual-pipeline-stage) (pp - 1) / (m * v), for v
  times the pipeline's sends (megapost.plan.search.comm_parts) and more activations in flight
  (megapost.plan.memory);
- communication (megapost.plan.search.comm_parts: bytes per GPU on a ring) at the bandwidth of the
  group's links: NVLink inside a node (``--intra-node-gbs``), the network between nodes
  (``--inter-node-gbs``); a group lies inside a node when its ranks' span does (megapost's rank order:
  TP fastest, then DP, then PP). TP's collectives and PP's sends are on the critical path, except the
  column-parallel input-gradient collectives of backward (megapost.parallel.async_linear: Q/K/V's and
  W_1/W_3's, half of TP's bytes, a quarter under SP), hidden up to the time of those layers' weight-
  gradient GEMMs, which they overlap (``tp_exposed``). The
  data-parallel reduction is hidden behind backward where the trainer overlaps it (ZeRO-2 and fp32
  ZeRO-1: DeepSpeed's ``overlap_comm``; bf16 ZeRO-1: megapost.ds_adapter.overlap; not under a
  pipeline): only what exceeds the backward it overlaps (every micro-batch's at ZeRO-2, the last
  one's at ZeRO-1) shows, plus the weight all-gather after the step; the ZeRO-0 reduction runs after
  backward, all of it exposed. megapost's distributed optimizer (megapost.parallel.dist_optimizer,
  a ``Layout`` flag: the native engine of ``--use-distributed-optimizer``, any PP) shows only its
  reduce-scatter beyond the last micro-batch's backward and its weight gather beyond the next step's
  first micro-batch forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapost.model import ModelConfig
from megapost.parallel.reduce_bytes import dist_optimizer_bytes, dp_step_bytes
from megapost.plan.counts import stage_parameters
from megapost.plan.memory import Layout

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """What the speed model needs of the machines."""

    peak_tflops: float = 989.0
    mfu: float = 0.4  # saturated MFU (large micro-batches)
    mfu_half_tokens: int = 256  # tokens per micro-batch at which MFU is half of ``mfu``
    gpus_per_node: int = 8
    intra_node_gbs: float = 450.0  # NVLink, GB/s per GPU per direction (H100 SXM: 900 both ways)
    inter_node_gbs: float = 50.0  # the network, GB/s per GPU (400 Gb/s InfiniBand per GPU)


def micro_batch_mfu(cluster: Cluster, tokens: int) -> float:
    """MFU at ``tokens`` per micro-batch (module docstring)."""
    return cluster.mfu * tokens / (tokens + cluster.mfu_half_tokens)


def step_flops(cfg: ModelConfig, layout: Layout, global_batch: int) -> float:
    """Model FLOPs of a step, plus the blocks' recomputed forward under activation checkpointing."""
    tokens = global_batch * cfg.seq_length
    flops = cfg.flops_per_token() * tokens
    if layout.checkpoint:  # recompute = the blocks' forward, a third of their training FLOPs
        flops += (cfg.flops_per_token() - 6.0 * cfg.hidden_size * cfg.vocab_size) / 3 * tokens
    return flops


def _bandwidth(cluster: Cluster, span: int) -> float:
    """Bytes/s of a group whose ranks span ``span`` consecutive global ranks."""
    return (cluster.intra_node_gbs if span <= cluster.gpus_per_node else cluster.inter_node_gbs) * GB


def dp_overlapped(layout: Layout, bf16: bool) -> bool:
    """Whether DeepSpeed overlaps this layout's data-parallel reduction with backward (as the trainer
    configures it on GPUs, megapost.config.resolved.grad_reduction)."""
    return layout.pp == 1 and layout.dp > 1 and layout.zero_stage >= 1


def step_parts(cfg: ModelConfig, layout: Layout, global_batch: int, bf16: bool, cluster: Cluster,
               comm: dict[str, float]) -> dict[str, float]:
    """Seconds of a step by cause: compute, bubble, tp, pp, dp (exposed); ``comm``: bytes per GPU
    (megapost.plan.search.comm_parts)."""
    lay = layout
    mfu = micro_batch_mfu(cluster, lay.micro_batch * cfg.seq_length)
    compute = step_flops(cfg, lay, global_batch) / (lay.gpus * cluster.peak_tflops * 1e12 * mfu)
    bubble = compute * (lay.pp - 1) / (lay.grad_accum * lay.virtual)
    tp = tp_exposed(cfg, lay, global_batch, cluster, mfu, comm["tp"]) if lay.tp > 1 else 0.0
    pp = comm["pp"] / _bandwidth(cluster, lay.tp * lay.dp * lay.pp) if lay.pp > 1 else 0.0
    dp_bw = _bandwidth(cluster, lay.tp * lay.dp)
    dp = comm["dp"] / dp_bw
    if lay.distributed_optimizer and lay.dp > 1:
        dp = _dist_optimizer_exposed(cfg, lay, bf16, compute, comm["dp"], dp_bw)
    elif dp_overlapped(lay, bf16):
        params = max(stage_parameters(cfg, lay.tp, lay.pp, s) for s in range(lay.pp))
        b = dp_step_bytes(params, lay.dp, lay.zero_stage, lay.grad_accum, bf16)
        backward = 2 / 3 * compute / lay.grad_accum  # one micro-batch's backward
        per_reduction = b.gradients / b.reductions / dp_bw
        dp = b.reductions * max(0.0, per_reduction - backward) + b.gather / dp_bw
    return {"compute": compute, "bubble": bubble, "tp": tp, "pp": pp, "dp": dp}


def tp_exposed(cfg: ModelConfig, lay: Layout, global_batch: int, cluster: Cluster, mfu: float,
               tp_bytes: float) -> float:
    """Seconds of TP communication on the critical path: all of it, less (with ``lay.tp_overlap``) the
    column-parallel input-gradient collectives of backward (half of the bytes; a quarter under SP, whose
    backward also all-gathers the row-parallel gradients), each hidden up to its weight-gradient GEMMs
    (Q/K/V and W_1/W_3: 2 h (h + 2 kv + 2 ffn) / tp FLOPs per token and layer)."""
    seconds = tp_bytes / _bandwidth(cluster, lay.tp)
    if not lay.tp_overlap:
        return seconds
    overlapped = seconds * (0.25 if lay.sequence_parallel else 0.5)
    kv = cfg.hidden_size * cfg.kv_groups // cfg.num_attention_heads
    columns = 2 * cfg.hidden_size * (cfg.hidden_size + 2 * kv + 2 * cfg.ffn_hidden_size)
    gemms = columns * global_batch * cfg.seq_length * cfg.num_layers / lay.gpus  # FLOPs per GPU
    return seconds - min(overlapped, gemms / (cluster.peak_tflops * 1e12 * mfu))


def _dist_optimizer_exposed(cfg: ModelConfig, lay: Layout, bf16: bool, compute: float, dp_bytes: float,
                            bw: float) -> float:
    """Seconds the distributed optimizer's communication shows: the reduce-scatter beyond the last
    micro-batch's backward it overlaps, the weight gather beyond the first micro-batch's forward of the
    next step (module docstring)."""
    params = max(stage_parameters(cfg, lay.tp, lay.pp, s) for s in range(lay.pp))
    gather = dist_optimizer_bytes(params, lay.dp, bf16).gather  # dp_bytes - gather: the reduce-scatter
    forward = compute / 3 / lay.grad_accum  # one micro-batch's forward (a third of its FLOPs)
    return max(0.0, (dp_bytes - gather) / bw - 2 * forward) + max(0.0, gather / bw - forward)


def step_time(cfg: ModelConfig, layout: Layout, global_batch: int, bf16: bool, cluster: Cluster,
              comm: dict[str, float]) -> float:
    """Seconds per optimizer step: the sum of ``step_parts``."""
    return sum(step_parts(cfg, layout, global_batch, bf16, cluster, comm).values())
