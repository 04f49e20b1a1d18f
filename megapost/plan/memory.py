"""Per-rank memory of one training layout, term by term, for what megapost and DeepSpeed allocate.

Model states (bytes per parameter on this rank, P; N = data-parallel size), by the optimizer DeepSpeed
builds for megapost's config (``megapost/optim/ds_config.py``):

- fp32, ZeRO-0: the engine wraps torch AdamW: weights 4P, gradients 4P, exp_avg + exp_avg_sq 8P.
- fp32, ZeRO-1/2 (``DeepSpeedZeroOptimizer``): flat weights 4P, an fp32 master copy of this rank's
  partition 4P/N and its Adam moments 8P/N; ZeRO-1 keeps full gradients 4P, ZeRO-2 only the
  partition 4P/N, plus the fp32 gradient partition flattened at the step 4P/N.
- bf16, ZeRO-1 (``BF16_Optimizer``, chosen for bf16 + stage 1 + fp32 ``grad_accum_dtype``): bf16
  weights 2P, a flat fp32 gradient accumulator over all of this rank's parameters 4P (not
  partitioned), fp32 master 4P/N and moments 8P/N — Megatron's 6 + 12/N bytes with its distributed
  optimizer. megapost sets ``immediate_grad_update``: a hook adds each bf16 param grad into the
  accumulator as autograd produces it and frees it, so only one (2x the largest tensor, plus its
  fp32 copy 4x) is alive at a time, during backward.
- bf16, ZeRO-2: weights 2P and 18P/N (bf16 gradient partition 2, its fp32 copy at the step 4, master
  4, moments 8) — exactly ``estimate_zero2_model_states_mem_needs(..., cpu_offload=False)``.

Buffers: ``DeepSpeedZeroOptimizer`` with ``contiguous_gradients`` (default on) allocates a
``reduce_bucket_size``-element gradient staging buffer (two with ``overlap_comm``); with N > 1 the
engine's fallback all-reduce (ZeRO-0 fp32, the BF16_Optimizer's fp32 accumulator; fp32
``communication_data_type``) flattens gradients into one fp32 copy per bucket of up to 5e8 elements —
at N = 1 megapost turns that reduction off (``engine_hooks.skip_single_rank_reduction``); pipeline
stages receive and send [b, s, h] activations and gradients. The optimizer is torch's fused AdamW on
every device (``megapost/optim/optimizer.py``): no per-tensor temporaries at the step.

Activations per block and micro-batch (T = b*s tokens, e = 2 bf16 / 4 fp32 bytes, t = TP,
Ts = T/t under sequence parallelism, else T), counted from what autograd saves in megapost's block
(fused SDPA saves q, k, v, out and the fp32 log-sum-exp, never the s x s scores; RoPE saves only its
tables; RMSNorm runs in fp32 and saves its fp32 input; residual adds save nothing):

  per sublayer: each of its residual-stream norms (the placement's rule: none, one, or Peri-LN's two)
  RMSNorm 8*Ts*h + 4*Ts on CPU (composite ``F.rms_norm``: its fp32 input, the fp32 normalised x,
  1/rms), e*Ts*h + 4*Ts with torch's fused CUDA kernel or apex (``norm_bytes``); DyT 8*Ts*h (fp32 x
  and tanh(a x)) plus, in bf16, the fp32 copies of its gain and scalar 4h + 4 (``stream_norm_bytes``);
  the sublayer's full-sequence input e*T*h (under SP the all-gathered copy the column-parallel linears
  keep);
  attention: e*T*(2h + 2kv)/t (q, k after RoPE, v, SDPA's output, which W_O reads as a view)
  + 4*b*s*a/t (log-sum-exp) + the block's cached RoPE tables 2*e*s*d_head (cos and signed sin in the
  activations' dtype); with per-head Q/K(/V) norms (--qk-norm, HybridNorm) each is an RMSNorm over
  rows of d_head (``norm_bytes`` of T*heads/t rows),
  and SDPA's output no longer has W_O's layout, so W_O keeps its own copy e*T*h/t;
  SwiGLU: 4 e*T*f/t (W_1 and W_3 outputs, SiLU output, their product).

Korthikanti et al. 2022 (eq. 2, fp16 GPT with dropout and materialised scores): s*b*h*(34 + 5*a*s/h)
per layer, /t with TP+SP; ``korthikanti_layer_bytes`` gives it for comparison. megapost has no
dropout, no s^2 term (SDPA), SwiGLU and fp32 norm inputs, hence its own count above.
Full checkpointing (``--checkpoint-activations``) keeps each segment's input e*Ts*h and recomputes one
segment during backward. 1F1B keeps ``min(pp - stage, micro-batches)`` micro-batches in flight on a
stage. The head (``head_bytes``): at TP=1 megapost's blocked cross-entropy (``megapost/model/loss.py``)
saves only the logits e*T*V and the fp32 log-sum-exp 4*T, and its backward holds the logits' gradient
e*T*V plus one fp32 block of rows (``BLOCK_ELEMENTS``; none for fp32 logits, which it rewrites in
place). Under TP the vocab-parallel loss keeps only the fp32 softmax 4*T*V/t (not the logits) and
its backward holds two more fp32 logit-sized tensors. Without a pipeline nothing else holds the logits;
DeepSpeed's pipeline keeps them in its output buffers (through the step). The chunked head + loss
(``--kernel-fusion`` ce: TP 1, no pipeline; under auto not in fp32; ``megapost/kernels/linear_ce.py``)
saves no logits, only the fp32 log-sum-exp 4*T; its backward holds the fp32 dW accumulator 4*V*h, one
chunk's product dz^T x e*V*h and one chunk of rows in fp32 and in the activations' dtype (4 + e)*rows*V.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from megapost.kernels.linear_ce import DEFAULT_CHUNK_ELEMENTS
from megapost.model import ModelConfig
from megapost.model.loss import DEFAULT_BLOCK_ELEMENTS
from megapost.plan.counts import kv_groups, kv_groups_per_rank, stage_layers, stage_parameters

ZERO0_ALLREDUCE_ELEMENTS = 500_000_000  # DeepSpeed engine's MEMORY_OPT_ALLREDUCE_SIZE
DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed ZeRO reduce/allgather_bucket_size defaults


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int
    grad_accum: int
    checkpoint: bool = False
    sequence_parallel: bool = False
    checkpoint_num_layers: int = 1
    distributed_optimizer: bool = False  # megapost.parallel.dist_optimizer (with zero_stage 1)
    virtual: int = 1  # chunks per pipeline rank: the interleaved 1F1B (native engine) when > 1
    tp_overlap: bool = True  # megapost.parallel.async_linear (--no-async-tensor-model-parallel-allreduce)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        ck = "ckpt" if self.checkpoint else "-"
        sp = "+SP" if self.sequence_parallel else ""
        zero = "DistOpt" if self.distributed_optimizer else f"ZeRO-{self.zero_stage}"
        pp = f"PP{self.pp}" + (f"v{self.virtual}" if self.virtual > 1 else "")
        return (f"TP{self.tp}{sp} {pp} DP{self.dp} {zero} mb{self.micro_batch} "
                f"ga{self.grad_accum} {ck}")


@dataclass(frozen=True)
class Precision:
    bf16: bool = True
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    fused_adam: bool = True  # torch's fused AdamW (megapost everywhere); False: torch's per-tensor loop
    norm_kernel: str = "fused"  # "composite" on CPU, "fused" (torch) or "apex" on CUDA: norm_bytes
    loss_block_elements: int = DEFAULT_BLOCK_ELEMENTS  # megapost.model.loss.BLOCK_ELEMENTS of the device
    packed: bool = True  # --kernel-fusion auto: packed Q/K/V and W_1/W_3 + fused SwiGLU in bf16 (fusion.py)
    chunked_ce: bool | None = None  # chunked head + loss at TP 1, PP 1: None (auto) outside fp32, else forced
    ce_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS  # megapost.kernels.linear_ce.CHUNK_ELEMENTS of the device

    @property
    def act_bytes(self) -> int:
        return 2 if self.bf16 else 4


@dataclass
class RankMemory:
    """Bytes on one rank of one pipeline stage; ``peak`` is the high-water mark over the step."""

    stage: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    peak: int
    phases: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def model_state_bytes(params: int, dp: int, zero_stage: int, bf16: bool) -> dict[str, int]:
    """weights / gradients / optimizer bytes for ``params`` on this rank (see the module docstring)."""
    n = dp
    if not bf16 and zero_stage == 0:
        return {"weights": 4 * params, "gradients": 4 * params, "optimizer": 8 * params}
    master_and_moments = 12 * params // n
    if bf16 and zero_stage == 1:  # the fp32 accumulator (bf16 grads are freed as they are added in)
        return {"weights": 2 * params, "gradients": 4 * params, "optimizer": master_and_moments}
    if bf16:  # ZeRO-2: bf16 partition + its fp32 copy at the step
        return {"weights": 2 * params, "gradients": 6 * params // n, "optimizer": master_and_moments}
    grads = 4 * params if zero_stage == 1 else 4 * params // n
    return {"weights": 4 * params, "gradients": grads + 4 * params // n, "optimizer": master_and_moments}


NORM_KERNELS = ("composite", "fused", "apex")


def norm_bytes(tokens: int, h: int, bf16: bool, kernel: str = "composite") -> int:
    """What megapost's RMSNorm saves (``F.rms_norm`` on the input's own dtype): on CPU the composite
    kernel upcasts internally and keeps the fp32 input and the fp32 normalised x; torch's fused CUDA
    kernel and apex's FusedRMSNorm keep the input in its own dtype; all keep fp32 1/rms per token."""
    per_token = {"composite": 8 * h, "fused": (2 if bf16 else 4) * h, "apex": (2 if bf16 else 4) * h}[kernel]
    return per_token * tokens + 4 * tokens


def stream_norm_bytes(cfg: ModelConfig, tokens: int, bf16: bool, kernel: str = "composite") -> int:
    """What one residual-stream norm of ``cfg``'s placement saves: RMSNorm (``norm_bytes``) or DyT
    (fp32 input and tanh output; in bf16 also the fp32 copies of its gain and scalar)."""
    h = cfg.hidden_size
    if cfg.norm_kind == "dyt":
        return 8 * tokens * h + (4 * h + 4 if bf16 else 0)
    return norm_bytes(tokens, h, bf16, kernel)


def layer_activation_bytes(cfg: ModelConfig, micro_batch: int, tp: int, sp: bool, e: int,
                           norm_kernel: str = "composite", layer_number: int = 1,
                           packed: bool = False) -> int:
    """Saved activations of block ``layer_number`` for one micro-batch (module docstring). ``packed``
    (``--kernel-fusion auto``, non-fp32 activations only): the packed Q/K/V GEMM's output stays whole while
    attention saves V, a view of it (+ the Q and K columns per token; not when V is normed: HybridNorm),
    and the fused SwiGLU keeps 3 ffn-wide tensors, not 4."""
    packed = packed and e != 4
    h, f, s, a = cfg.hidden_size, cfg.ffn_hidden_size, cfg.seq_length, cfg.num_attention_heads
    t_all = micro_batch * s
    t_sp = t_all // tp if sp else t_all
    kv_heads = kv_groups_per_rank(cfg, tp) if tp > 1 else kv_groups(cfg)
    kv = (a // tp if e == 4 else kv_heads) * cfg.head_dim  # fp32 GQA: SDPA keeps the repeated K/V
    attn_rule, ffn_rule = cfg.rules(layer_number)
    norms = sum(int(r.norm_input is not None) + int(r.output_norm) for r in (attn_rule, ffn_rule))
    sublayers = norms * stream_norm_bytes(cfg, t_sp, e == 2, norm_kernel) + 2 * e * t_all * h
    rope_tables = 2 * e * s * cfg.head_dim  # cos and signed sin, cached in the activations' dtype
    attention = e * t_all * (2 * h // tp + 2 * kv) + 4 * micro_batch * s * (a // tp) + rope_tables
    if attn_rule.qkv_norm or cfg.qk_norm:
        rows = [t_all * (a // tp), t_all * kv_heads] + ([t_all * kv_heads] if attn_rule.qkv_norm else [])
        attention += sum(norm_bytes(n, cfg.head_dim, e == 2, norm_kernel) for n in rows) + e * t_all * h // tp
    if packed and not attn_rule.qkv_norm:
        attention += e * t_all * (h // tp + kv)
    mlp = (3 if packed else 4) * e * t_all * f // tp
    return sublayers + attention + mlp


def korthikanti_layer_bytes(cfg: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022's per-layer activation bytes (fp16 GPT, eq. 2-5): s*b*h*(34 + 5as/h),
    divided by t with TP+SP; with TP alone 10 sbh stays replicated."""
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    if tp == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h * (34 + 5 * a * s / h) / tp
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def head_bytes(cfg: ModelConfig, micro_batch: int, tp: int, sp: bool, e: int,
               norm_kernel: str = "composite", block_elements: int = DEFAULT_BLOCK_ELEMENTS,
               pipelined: bool = False, chunk_elements: int | None = None) -> tuple[int, int]:
    """(saved by the head for one micro-batch, extra transient in its backward): module docstring.
    ``chunk_elements``: the chunked head + loss runs (where it can: TP 1, no pipeline)."""
    h, v, t_all = cfg.hidden_size, cfg.vocab_size // tp, micro_batch * cfg.seq_length
    t_sp = t_all // tp if sp else t_all
    norm = stream_norm_bytes(cfg, t_sp, e == 2, norm_kernel) if cfg.final_norm else 0
    if chunk_elements and tp == 1 and not pipelined:
        rows = min(t_all, max(1, chunk_elements // max(v, 1)))
        return norm + e * t_all * h + 4 * t_all, (4 + e) * v * h + (4 + e) * rows * v
    if tp == 1:  # blocked CE: logits + log-sum-exp; backward: dlogits + one fp32 block (bf16 logits)
        rows = min(t_all, max(1, block_elements // max(v, 1)))
        block = 4 * rows * v if e != 4 else 0
        return norm + e * t_all * h + e * t_all * v + 4 * t_all, e * t_all * v + block
    held = e * t_all * v if pipelined else 0  # the pipeline's output buffer; else nothing holds them
    return norm + e * t_all * h + held + 4 * t_all * v, 2 * 4 * t_all * v


def _optimizer_kind(zero_stage: int, bf16: bool) -> str:
    if zero_stage == 0:
        return "torch"  # the engine steps torch AdamW itself (fp32 only: bf16 promotes ZeRO-0 to 1)
    return "bf16_optimizer" if bf16 and zero_stage == 1 else "zero"


def stage_memory(cfg: ModelConfig, layout: Layout, prec: Precision, stage: int) -> RankMemory:
    """Memory of one rank on pipeline ``stage`` of ``layout``: the components, and the peak as the
    largest of three phases of a step —

    backward: states + every in-flight micro-batch's saved activations + the head's backward
      transient + the gradients alive then (full ones when accumulated over micro-batches, the
      BF16_Optimizer's fp32 accumulator always, plus one bf16 param grad and its fp32 copy) + the ZeRO
      staging bucket;
    gradient reduction (ZeRO-0 and BF16_Optimizer, N > 1 only): states + gradients + DeepSpeed's flat
      all-reduce copy;
    optimizer step: states + the gradients the step reads (ZeRO: the flat partition and its fp32
      copy; BF16_Optimizer: its accumulator, already in the states) + Adam's temporaries (two of the
      largest stepped tensor for torch's unfused AdamW; none for the fused kernel megapost uses).
    Under a pipeline the logits of the last micro-batch stay in its output buffer through the step."""
    e, lay, n = prec.act_bytes, layout, layout.dp
    params = stage_parameters(cfg, lay.tp, lay.pp, stage)
    states = model_state_bytes(params, n, lay.zero_stage, prec.bf16)
    kind = _optimizer_kind(lay.zero_stage, prec.bf16)
    tokens = lay.micro_batch * cfg.seq_length
    t_sp = tokens // lay.tp if lay.sequence_parallel else tokens
    kept, recompute = _saved_activations(cfg, lay, prec, stage, t_sp)
    m = lay.grad_accum
    in_flight = min(lay.pp - stage, m) if lay.pp > 1 else 1
    if lay.virtual > 1:  # interleaved: Korthikanti et al. 2022's 1 + (pp - 1) / (pp v) more in flight
        in_flight = min(m, math.ceil(in_flight * (1 + (lay.pp - 1) / (lay.pp * lay.virtual))))
    boundary = e * t_sp * cfg.hidden_size  # a stage's received input / sent output per micro-batch
    per_micro = kept + (2 * boundary if lay.pp > 1 else 0)
    last = stage == lay.pp - 1
    chunked = prec.chunked_ce if prec.chunked_ce is not None else e != 4
    chunk = prec.ce_chunk_elements if chunked else None
    head_saved, head_transient = (head_bytes(cfg, lay.micro_batch, lay.tp, lay.sequence_parallel, e,
                                             prec.norm_kernel, prec.loss_block_elements, lay.pp > 1, chunk)
                                  if last else (0, 0))
    logits = e * tokens * cfg.vocab_size // lay.tp if last else 0
    held_at_step = logits if lay.pp > 1 else 0  # without a pipeline the loss's graph holds them last
    # DeepSpeed's pipeline keeps each buffer's outputs (the last stage's logits) until reused:
    # max(2, in-flight) buffers, as many as there are micro-batches.
    held_logits = (min(max(2, in_flight), m) - 1) * logits if lay.pp > 1 else 0
    act = in_flight * per_micro + head_saved + held_logits
    # buffers
    bucket = prec.reduce_bucket_size * e * (2 if prec.overlap_comm else 1) if (
        kind == "zero" and prec.contiguous_gradients) else 0
    reduced = kind != "zero" and n > 1  # the engine's fallback all-reduce (off at N = 1)
    flat_allreduce = 4 * min(params, ZERO0_ALLREDUCE_ELEMENTS) if reduced else 0
    pipe_buffers = 2 * boundary if lay.pp > 1 else 0
    buffers = max(bucket, flat_allreduce) + pipe_buffers
    full_grads = 4 * params if kind != "zero" or lay.zero_stage == 1 else 0  # fp32 grads held in full
    model_states = states["weights"] + states["optimizer"]
    if kind == "bf16_optimizer":  # the fp32 accumulator lives from initialisation on
        model_states += 4 * params
    # gradients alive while a later micro-batch runs backward: fp32 param grads (ZeRO-0/1) or the
    # ZeRO-2 partition; the BF16_Optimizer's accumulator is in model_states and its bf16 grads are freed
    accumulated = {"torch": full_grads, "bf16_optimizer": 0}.get(kind, full_grads)
    if kind == "zero" and lay.zero_stage == 2:
        accumulated = e * params // n
    largest = _largest_tensor(cfg, lay.tp, stage, lay.pp)
    grad_hook = 6 * largest if kind == "bf16_optimizer" else 0  # one bf16 grad + its fp32 copy
    # the head's backward transient, a checkpointed segment's recompute and a grad hook do not overlap
    transient = max(head_transient, recompute, grad_hook)
    first = in_flight * per_micro + head_saved + held_logits + transient
    alive = in_flight if m > in_flight else in_flight - 1  # micro-batches in flight at a later backward
    later = (alive * per_micro + head_saved + held_logits + transient + accumulated) if m > 1 else 0
    stepped = 4 * params // n if kind != "torch" else 4 * largest
    adam_temps = 0 if prec.fused_adam else 2 * stepped
    if kind == "torch":
        step_grads = full_grads
    elif kind == "bf16_optimizer":
        step_grads = 0
    else:  # stage 1: param grads + the averaged flat partition; stage 2: the partition + its fp32 copy
        step_grads = (full_grads + 4 * params // n) if lay.zero_stage == 1 else (e + 4) * params // n
    phases = {
        "backward": model_states + max(first, later) + bucket + pipe_buffers,
        "optimizer step": model_states + held_at_step + held_logits + step_grads + adam_temps,
    }
    if reduced:
        phases["gradient reduction"] = model_states + held_at_step + held_logits + full_grads + flat_allreduce
    act += recompute
    return RankMemory(stage, params, states["weights"], states["gradients"], states["optimizer"],
                      act, buffers, max(phases.values()), phases)


def _saved_activations(cfg: ModelConfig, lay: Layout, prec: Precision, stage: int,
                       t_sp: int) -> tuple[int, int]:
    """(activations one micro-batch keeps on ``stage`` for its backward, the largest recompute
    transient): every layer's saved tensors, or under activation checkpointing one segment input per
    ``checkpoint_num_layers`` layers and the largest segment recomputed."""
    e, n_layers = prec.act_bytes, stage_layers(cfg.num_layers, lay.pp)[stage]
    first = sum(stage_layers(cfg.num_layers, lay.pp)[:stage]) + 1
    per_layer = [layer_activation_bytes(cfg, lay.micro_batch, lay.tp, lay.sequence_parallel, e,
                                        prec.norm_kernel, n, prec.packed)
                 for n in range(first, first + n_layers)]
    if not lay.checkpoint:
        return sum(per_layer), 0
    k = lay.checkpoint_num_layers
    kept = -(-n_layers // k) * e * t_sp * cfg.hidden_size
    return kept, max((sum(per_layer[i:i + k]) for i in range(0, n_layers, k)), default=0)


def _largest_tensor(cfg: ModelConfig, tp: int, stage: int, pp: int) -> int:
    """Elements of the largest parameter on the rank (the embedding or head shard, else W_1)."""
    big = cfg.ffn_hidden_size * cfg.hidden_size // tp
    if stage in (0, pp - 1):
        big = max(big, cfg.vocab_size * cfg.hidden_size // tp)
    return big


def rank_memory(cfg: ModelConfig, layout: Layout, prec: Precision) -> list[RankMemory]:
    """Every pipeline stage's per-rank memory."""
    return [stage_memory(cfg, layout, prec, stage) for stage in range(layout.pp)]


ASYNC_SAVE_BYTES_PER_PARAMETER = 12  # fp32 master + Adam's two fp32 moments (checkpoint/sharded.py)


def async_save_host_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """Host memory ``--async-save`` holds per rank between saves (checkpoint/sharded.py ``HostPool``:
    one flat buffer, pinned on CUDA): the fp32 master and two moments of what the rank writes — its
    ZeRO partition, or at ZeRO-0 its whole TP/PP shard on data-parallel rank 0 — on the largest stage."""
    params = max(stage_parameters(cfg, layout.tp, layout.pp, s) for s in range(layout.pp))
    owned = params if layout.zero_stage == 0 else -(-params // layout.dp)
    return ASYNC_SAVE_BYTES_PER_PARAMETER * owned
