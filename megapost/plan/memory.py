"""Per-rank memory of one training layout, term by term, for what megapost and DeepSpeed allocate.

Model states (bytes per parameter on this rank, P; N = data-parallel size), by the optimizer DeepSpeed
builds for megapost's config (``megapost/ds_config_builder.py``):

- fp32, ZeRO-0: the engine wraps torch AdamW: weights 4P, gradients 4P, exp_avg + exp_avg_sq 8P.
- fp32, ZeRO-1/2 (``DeepSpeedZeroOptimizer``): flat weights 4P, an fp32 master copy of this rank's
  partition 4P/N and its Adam moments 8P/N; ZeRO-1 keeps full gradients 4P, ZeRO-2 only the
  partition 4P/N, plus the fp32 gradient partition flattened at the step 4P/N.
- bf16, ZeRO-1 (``BF16_Optimizer``, chosen for bf16 + stage 1 + fp32 ``grad_accum_dtype``): bf16
  weights 2P, a flat fp32 gradient accumulator over all of this rank's parameters 4P (not
  partitioned), fp32 master 4P/N and moments 8P/N — Megatron's 6 + 12/N bytes with its distributed
  optimizer — plus the bf16 param grads 2P it accumulates from (without ``immediate_grad_update``
  they are zeroed, not freed, between micro-batches, and live until the step).
- bf16, ZeRO-2: weights 2P and 18P/N (bf16 gradient partition 2, its fp32 copy at the step 4, master
  4, moments 8) — exactly ``estimate_zero2_model_states_mem_needs(..., cpu_offload=False)``.

Buffers: ``DeepSpeedZeroOptimizer`` with ``contiguous_gradients`` (default on) allocates a
``reduce_bucket_size``-element gradient staging buffer (two with ``overlap_comm``); the ZeRO-0 engine
flattens gradients into one copy per all-reduce of up to 5e8 elements; pipeline stages receive and
send [b, s, h] activations and gradients.

Activations per block and micro-batch (T = b*s tokens, e = 2 bf16 / 4 fp32 bytes, t = TP,
Ts = T/t under sequence parallelism, else T), counted from what autograd saves in megapost's block
(fused SDPA saves q, k, v, out and the fp32 log-sum-exp, never the s x s scores; RoPE saves only its
tables; RMSNorm runs in fp32 and saves its fp32 input; residual adds save nothing):

  per sublayer: RMSNorm 8*Ts*h + 4*Ts on CPU (composite ``F.rms_norm``: its fp32 input, the fp32
  normalised x, 1/rms), e*Ts*h + 4*Ts with torch's fused CUDA kernel or apex (``norm_bytes``), the
  sublayer's full-sequence input e*T*h (under SP the all-gathered copy the column-parallel linears keep);
  attention: e*T*(2h + 2kv)/t (q, k after RoPE, v, SDPA's output, which W_O reads as a view)
  + 4*b*s*a/t (log-sum-exp) + the block's cached RoPE tables 8*s*d_head;
  SwiGLU: 4 e*T*f/t (W_1 and W_3 outputs, SiLU output, their product).

Korthikanti et al. 2022 (eq. 2, fp16 GPT with dropout and materialised scores): s*b*h*(34 + 5*a*s/h)
per layer, /t with TP+SP; ``korthikanti_layer_bytes`` gives it for comparison. megapost has no
dropout, no s^2 term (SDPA), SwiGLU and fp32 norm inputs, hence its own count above.
Full checkpointing (``--checkpoint-activations``) keeps each segment's input e*Ts*h and recomputes one
segment during backward. 1F1B keeps ``min(pp - stage, micro-batches)`` micro-batches in flight on a
stage. The head keeps the vocab-parallel logits e*T*V/t and the fp32 softmax (TP) or log-softmax
(TP=1) 4*T*V/t, and its backward briefly holds two more fp32 logit-sized tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megapost.model import ModelConfig

from .counts import kv_groups, kv_groups_per_rank, stage_layers, stage_parameters

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

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        ck = "ckpt" if self.checkpoint else "-"
        sp = "+SP" if self.sequence_parallel else ""
        return (f"TP{self.tp}{sp} PP{self.pp} DP{self.dp} ZeRO-{self.zero_stage} mb{self.micro_batch} "
                f"ga{self.grad_accum} {ck}")


@dataclass(frozen=True)
class Precision:
    bf16: bool = True
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    fused_adam: bool = True  # torch's fused AdamW (megapost on CUDA); False: the unfused CPU loop
    norm_kernel: str = "fused"  # "composite" on CPU, "fused" (torch) or "apex" on CUDA: norm_bytes

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
    if bf16 and zero_stage == 1:  # fp32 accumulator + the bf16 param grads it is fed from
        return {"weights": 2 * params, "gradients": 6 * params, "optimizer": master_and_moments}
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


def layer_activation_bytes(cfg: ModelConfig, micro_batch: int, tp: int, sp: bool, e: int,
                           norm_kernel: str = "composite") -> int:
    """Saved activations of one block for one micro-batch (module docstring)."""
    h, f, s, a = cfg.hidden_size, cfg.ffn_hidden_size, cfg.seq_length, cfg.num_attention_heads
    t_all = micro_batch * s
    t_sp = t_all // tp if sp else t_all
    kv = kv_groups_per_rank(cfg, tp) * cfg.head_dim if tp > 1 else kv_groups(cfg) * cfg.head_dim
    sublayer = norm_bytes(t_sp, h, e == 2, norm_kernel) + e * t_all * h
    attention = e * t_all * (2 * h // tp + 2 * kv) + 4 * micro_batch * s * (a // tp) + 8 * s * cfg.head_dim
    mlp = 4 * e * t_all * f // tp
    return 2 * sublayer + attention + mlp


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
               norm_kernel: str = "composite") -> tuple[int, int]:
    """(saved by the head for one micro-batch, extra transient in its backward)."""
    h, v, t_all = cfg.hidden_size, cfg.vocab_size // tp, micro_batch * cfg.seq_length
    t_sp = t_all // tp if sp else t_all
    norm = norm_bytes(t_sp, h, e == 2, norm_kernel) if cfg.norm_position == "pre" else 0
    saved = norm + e * t_all * h + e * t_all * v + 4 * t_all * v
    return saved, 2 * 4 * t_all * v


def _optimizer_kind(zero_stage: int, bf16: bool) -> str:
    if zero_stage == 0:
        return "torch"  # the engine steps torch AdamW itself (fp32 only: bf16 promotes ZeRO-0 to 1)
    return "bf16_optimizer" if bf16 and zero_stage == 1 else "zero"


def stage_memory(cfg: ModelConfig, layout: Layout, prec: Precision, stage: int) -> RankMemory:
    """Memory of one rank on pipeline ``stage`` of ``layout``: the components, and the peak as the
    largest of three phases of a step —

    backward: states + every in-flight micro-batch's saved activations + the head's backward
      transient + the gradients alive then (full ones when accumulated over micro-batches, the
      BF16_Optimizer's fp32 accumulator always) + the ZeRO staging bucket;
    gradient reduction (ZeRO-0): states + gradients + DeepSpeed's flat all-reduce copy;
    optimizer step: states + the gradients the step reads (ZeRO: the flat partition and its fp32
      copy) + Adam's temporaries (two of the largest stepped tensor for torch's unfused CPU AdamW;
      none for the fused CUDA kernel megapost uses on GPUs).
    The logits of the last micro-batch stay referenced by the training loop through the step."""
    e, lay, n = prec.act_bytes, layout, layout.dp
    params = stage_parameters(cfg, lay.tp, lay.pp, stage)
    states = model_state_bytes(params, n, lay.zero_stage, prec.bf16)
    kind = _optimizer_kind(lay.zero_stage, prec.bf16)
    n_layers = stage_layers(cfg.num_layers, lay.pp)[stage]
    tokens = lay.micro_batch * cfg.seq_length
    t_sp = tokens // lay.tp if lay.sequence_parallel else tokens
    per_layer = layer_activation_bytes(cfg, lay.micro_batch, lay.tp, lay.sequence_parallel, e,
                                       prec.norm_kernel)
    if lay.checkpoint:
        k = lay.checkpoint_num_layers
        kept = -(-n_layers // k) * e * t_sp * cfg.hidden_size
        recompute = min(k, n_layers) * per_layer
    else:
        kept, recompute = n_layers * per_layer, 0
    m = lay.grad_accum
    in_flight = min(lay.pp - stage, m) if lay.pp > 1 else 1
    boundary = e * t_sp * cfg.hidden_size  # a stage's received input / sent output per micro-batch
    per_micro = kept + (2 * boundary if lay.pp > 1 else 0)
    last = stage == lay.pp - 1
    head_saved, head_transient = (head_bytes(cfg, lay.micro_batch, lay.tp, lay.sequence_parallel, e,
                                             prec.norm_kernel) if last else (0, 0))
    logits = e * tokens * cfg.vocab_size // lay.tp if last else 0
    # DeepSpeed's pipeline keeps each buffer's outputs (the last stage's logits) until reused:
    # max(2, in-flight) buffers, as many as there are micro-batches.
    held_logits = (min(max(2, in_flight), m) - 1) * logits if lay.pp > 1 else 0
    act = in_flight * per_micro + head_saved + held_logits
    # buffers
    bucket = prec.reduce_bucket_size * e * (2 if prec.overlap_comm else 1) if (
        kind == "zero" and prec.contiguous_gradients) else 0
    flat_allreduce = 4 * min(params, ZERO0_ALLREDUCE_ELEMENTS) if kind == "torch" else 0
    pipe_buffers = 2 * boundary if lay.pp > 1 else 0
    buffers = max(bucket, flat_allreduce) + pipe_buffers
    full_grads = 4 * params if kind != "zero" or lay.zero_stage == 1 else 0  # fp32 grads held in full
    model_states = states["weights"] + states["optimizer"]
    if kind == "bf16_optimizer":  # the fp32 accumulator lives from initialisation on
        model_states += 4 * params
    # gradients alive while a later micro-batch runs backward: fp32 param grads (ZeRO-0/1), the
    # ZeRO-2 partition, or the BF16_Optimizer's bf16 param grads (zeroed, not freed, between micro-batches)
    accumulated = {"torch": full_grads, "bf16_optimizer": 2 * params}.get(kind, full_grads)
    if kind == "zero" and lay.zero_stage == 2:
        accumulated = e * params // n
    # the head's backward transient and a checkpointed segment's recompute do not overlap
    transient = max(head_transient, recompute)
    first = in_flight * per_micro + head_saved + held_logits + transient
    alive = in_flight if m > in_flight else in_flight - 1  # micro-batches in flight at a later backward
    later = (alive * per_micro + head_saved + held_logits + transient + accumulated) if m > 1 else 0
    largest = 4 * params // n if kind != "torch" else 4 * _largest_tensor(cfg, lay.tp, stage, lay.pp)
    adam_temps = 0 if prec.fused_adam else 2 * largest
    if kind == "torch":
        step_grads = full_grads
    elif kind == "bf16_optimizer":
        step_grads = 2 * params
    else:  # stage 1: param grads + the averaged flat partition; stage 2: the partition + its fp32 copy
        step_grads = (full_grads + 4 * params // n) if lay.zero_stage == 1 else (e + 4) * params // n
    phases = {
        "backward": model_states + max(first, later) + bucket + pipe_buffers,
        "optimizer step": model_states + logits + held_logits + step_grads + adam_temps,
    }
    if kind == "torch":
        phases["gradient reduction"] = model_states + logits + held_logits + full_grads + flat_allreduce
    act += recompute
    return RankMemory(stage, params, states["weights"], states["gradients"], states["optimizer"],
                      act, buffers, max(phases.values()), phases)


def _largest_tensor(cfg: ModelConfig, tp: int, stage: int, pp: int) -> int:
    """Elements of the largest parameter on the rank (the embedding or head shard, else W_1)."""
    big = cfg.ffn_hidden_size * cfg.hidden_size // tp
    if stage in (0, pp - 1):
        big = max(big, cfg.vocab_size * cfg.hidden_size // tp)
    return big


def rank_memory(cfg: ModelConfig, layout: Layout, prec: Precision) -> list[RankMemory]:
    """Every pipeline stage's per-rank memory."""
    return [stage_memory(cfg, layout, prec, stage) for stage in range(layout.pp)]
