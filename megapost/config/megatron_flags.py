"""Megatron-LM's flags for a Llama run: accepted with Megatron's meaning, mapped to megapost's, or
refused in one line that says what megapost supports instead. Nothing is silently ignored: flags
that change nothing here (megapost already does what they ask) are listed once at start-up."""

from __future__ import annotations

import argparse
import math

from megapost.config.errors import ConfigError, Errors
from megapost.config.logging_flags import add_logging_arguments, check_logging_arguments
from megapost.config.megatron_habits import add_habit_arguments, apply_habits

# Flags without a value that ask for what megapost always does.
ALWAYS: dict[str, str] = {
    "--swiglu": "the FFN is always SwiGLU",
    "--untie-embeddings-and-output-weights": "the LM head is always untied",
    "--disable-bias-linear": "linear layers never have biases",
    "--use-rotary-position-embeddings": "RoPE is the only position embedding",
    "--use-flash-attn": "attention is torch SDPA, which picks its flash kernel where available",
    "--use-mcore-models": "megapost's model is its own (Llama block)",
    "--log-throughput": "tokens/s, TFLOP/s and MFU are always logged",
    "--log-timers-to-tensorboard": "step throughput is always written to TensorBoard",
    "--no-masked-softmax-fusion": "attention is torch SDPA",
    "--no-bias-gelu-fusion": "no GELU / biases",
    "--no-bias-dropout-fusion": "no dropout / biases",
    "--no-bias-swiglu-fusion": "no biases; the SwiGLU gate's fusion is --kernel-fusion's (docs/kernels.md)",
    "--no-rope-fusion": "RoPE's fusion is bit-exact and on; --kernel-fusion none turns every fusion off",
    "--attention-softmax-in-fp32": "SDPA accumulates the softmax in fp32",
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated in fp32 under --bf16",
    "--no-position-embedding": "no learned position table (RoPE)",
    "--no-gradient-accumulation-fusion": ("bf16 gradients are added into the fp32 buffer without a cast "
                                          "(bit-exact); --kernel-fusion none turns it off"),
    "--overlap-param-gather": ("ZeRO-1/2 gather the updated parameters once after the optimizer step, "
                               "not overlapped with the next forward"),
}

# Flags with a value: dest -> (allowed values as text, what megapost supports instead).
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "normalization": (("RMSNorm",), "megapost's norms are RMSNorm (--normalization RMSNorm)"),
    "position_embedding_type": (("rope",), "megapost uses RoPE (--position-embedding-type rope)"),
    "transformer_impl": (("local", "transformer_engine"), "megapost's own torch layers run, not Transformer "
                         "Engine's (Megatron's default is transformer_engine)"),
    "dataloader_type": (("single",), "samples are read in the dataset's shuffled order, resumable by "
                        "consumed samples (Megatron's single); no per-epoch reshuffle (cyclic)"),
}

# Megatron flags whose (checked) values mean what megapost does anyway; listed at start-up when typed.
SAME_MEANING = ("rotary_percent", "kv_channels", "max_position_embeddings", "attention_dropout",
                "hidden_dropout", "context_parallel_size", "tokenizer_type")

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "NullTokenizer")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    """Megatron-LM spellings megapost understands (see ``apply_megatron_arguments``)."""
    g = p.add_argument_group("Megatron-LM compatibility")
    for flag, why in ALWAYS.items():
        g.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for dest, (allowed, why) in CHOICES.items():
        g.add_argument("--" + dest.replace("_", "-"), dest=dest,
                       help=f"accepted: {', '.join(allowed)} ({why})")
    alias = dict(default=argparse.SUPPRESS)
    g.add_argument("--norm-epsilon", dest="norm_eps", type=float, help="= --norm-eps", **alias)
    g.add_argument("--qk-layernorm", dest="qk_norm", action="store_true",
                   help="= --qk-norm (per-head norm of queries and keys, as megatron-core's)", **alias)
    g.add_argument("--rotary-base", dest="rope_theta", type=float, help="= --rope-theta", **alias)
    g.add_argument("--data-cache-path", dest="data_cache_dir", help="= --data-cache-dir", **alias)
    g.add_argument("--rotary-percent", type=float, default=1.0, help="only 1.0 (full rotary)")
    g.add_argument("--max-position-embeddings", type=int, help="accepted when >= --seq-length (RoPE)")
    g.add_argument("--kv-channels", type=int, help="must equal hidden/heads")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="only 0")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="only 0")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="reduce gradient buckets during backward (bf16 ZeRO-1: megapost's buckets of "
                   "the fp32 accumulator, all-reduced during the last micro-batch's backward, as "
                   "Megatron's DDP; ZeRO-2 and fp32 ZeRO-1: DeepSpeed's overlap_comm); default: on "
                   "when DP > 1 on GPUs")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients in bf16 (default fp32, as Megatron's default)")
    g.add_argument("--fp16", action="store_true", help="refused: use --bf16")
    g.add_argument("--num-experts", type=int, help="refused: megapost has no MoE")
    g.add_argument("--context-parallel-size", type=int, default=1, help="only 1")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per virtual pipeline stage: the interleaved 1F1B schedule (native engine, "
                   "--use-distributed-optimizer; DeepSpeed's pipeline engine runs 1F1B only)")
    g.add_argument("--train-samples", type=int, help="--train-iters = samples / global batch")
    g.add_argument("--lr-decay-samples", type=int, help="--lr-decay-iters = samples / global batch")
    g.add_argument("--lr-warmup-samples", type=int, help="--lr-warmup-iters = samples / global batch")
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup = fraction x --lr-decay-iters")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate at the start of the linear warmup (Megatron's)")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_STYLES, default="exponential",
                   help="annealing shape of --lr-decay-style WSD")
    g.add_argument("--lr-wsd-decay-iters", type=int, help="WSD annealing length in iterations")
    g.add_argument("--lr-wsd-decay-samples", type=int, help="WSD annealing length in samples")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recompute: nothing to do (SDPA keeps no attention matrix)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, help="layers per recompute segment (uniform)")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", dest="async_tensor_model_parallel_allreduce",
                   action="store_false", help="TP > 1: all-reduce (SP: reduce-scatter) a column-parallel "
                   "layer's input gradient before computing its weight gradient, not overlapped with it "
                   "(the default overlaps them: megapost.parallel.async_linear)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="= --zero-stage 1 (optimizer state sharded over data-parallel ranks)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="SentencePieceTokenizer",
                   help="SentencePiece kinds take a .model; HuggingFaceTokenizer a local directory")
    g.add_argument("--vocab-size", type=int, help="vocabulary of --tokenizer-type NullTokenizer")
    g.add_argument("--num-workers", type=int, default=0,
                   help="accepted: samples are read from the memory-mapped .bin in the training process")
    g.add_argument("--train-data-path", nargs="+", help="train blend (weights and prefixes)")
    g.add_argument("--valid-data-path", nargs="+", help="validation blend")
    g.add_argument("--test-data-path", nargs="+", help="test blend")
    g.add_argument("--data-args-path", help="file holding the --data-path list")
    g.add_argument("--per-split-data-args-path", help='JSON {"train": [...], "valid": [...], "test": [...]}')
    add_habit_arguments(g, p)
    add_logging_arguments(g)


def _refuse(flag: str, what: str) -> ConfigError:
    return ConfigError(f"{flag}: {what}")


def _compatibility_notes(args: argparse.Namespace) -> list[str]:
    """Accepted flags that change nothing here, each with what megapost does instead."""
    notes = []
    if getattr(args, "deepspeed", False):
        notes.append("--deepspeed (megapost always trains through DeepSpeed)")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        notes.append(f"--vocab-size {args.vocab_size} not used: the vocabulary comes from "
                     f"--tokenizer-type {args.tokenizer_type} (padded to --make-vocab-size-divisible-by)")
    return notes


def _samples_to_iters(args: argparse.Namespace, samples: int, flag: str) -> int:
    if samples < 0:
        raise _refuse(flag, f"must be >= 0, got {samples}")
    return samples // args.global_batch_size


def apply_megatron_arguments(args: argparse.Namespace) -> list[str]:
    """Check and translate the Megatron spellings on ``args``; returns the start-up notes."""
    notes = [f"{flag} ({why})" for flag, why in ALWAYS.items() if getattr(args, flag[2:].replace("-", "_"))]
    same = [f"--{d.replace('_', '-')} {getattr(args, d)}" for d in (*CHOICES, *SAME_MEANING)
            if d in args.explicit and d != "transformer_impl"]  # not Megatron's meaning: its own note
    if same:
        notes.append("with Megatron's meaning: " + ", ".join(same))
    errors = Errors()
    for dest, (allowed, why) in CHOICES.items():
        value = getattr(args, dest)
        if value is not None and value not in allowed:
            errors.add(_refuse(f"--{dest.replace('_', '-')} {value}", f"not supported; {why}"))
        elif value is not None:
            notes.append(f"--{dest.replace('_', '-')} {value} ({why})")
    notes += _compatibility_notes(args)
    for refusal in _refusals(args):
        errors.add(refusal)
    with errors:
        _apply_schedule(args)
    with errors:
        notes += _apply_recompute(args)
    with errors:
        notes += apply_distributed_optimizer(args)
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        errors.add(_refuse("--tokenizer-type NullTokenizer", "needs --vocab-size N"))
    if args.num_workers:
        notes.append(f"--num-workers {args.num_workers} (samples are read from the mmap in-process)")
    with errors:
        notes += apply_habits(args)
    with errors:
        notes += check_logging_arguments(args)
    errors.raise_all()
    return notes


def _refusals(args: argparse.Namespace) -> list[ConfigError]:
    """Megatron features megapost lacks, each refused in one line."""
    out = []
    if args.fp16:
        out.append(_refuse("--fp16", "fp16 with loss scaling is not supported; use --bf16"))
    if args.num_experts:
        out.append(_refuse(f"--num-experts {args.num_experts}", "mixture-of-experts is not supported; "
                           "megapost trains dense Llama blocks"))
    for flag in ("attention_dropout", "hidden_dropout"):
        if getattr(args, flag):
            out.append(_refuse(f"--{flag.replace('_', '-')} {getattr(args, flag)}",
                               "dropout is not supported (the study trains without it); use 0"))
    if args.context_parallel_size != 1:
        out.append(_refuse(f"--context-parallel-size {args.context_parallel_size}", "context parallelism "
                           "is not supported; use --sequence-parallel with --tensor-model-parallel-size"))
    if (virtual := args.num_layers_per_virtual_pipeline_stage) is not None:
        out += _virtual_stage_errors(args, virtual)
    if args.rotary_percent != 1.0:
        out.append(_refuse(f"--rotary-percent {args.rotary_percent}", "only full rotary embeddings (1.0)"))
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        out.append(_refuse(f"--max-position-embeddings {args.max_position_embeddings}",
                           f"is below --seq-length {args.seq_length}"))
    if args.kv_channels is not None and args.kv_channels * args.num_attention_heads != args.hidden_size:
        out.append(_refuse(f"--kv-channels {args.kv_channels}", f"must equal --hidden-size "
                           f"{args.hidden_size} / --num-attention-heads {args.num_attention_heads}"))
    return out


def _virtual_stage_errors(args: argparse.Namespace, virtual: int) -> list[ConfigError]:
    """--num-layers-per-virtual-pipeline-stage: the native engine only, at PP > 1, dividing the layers."""
    flag, pp = f"--num-layers-per-virtual-pipeline-stage {virtual}", args.pipeline_model_parallel_size
    if not args.use_distributed_optimizer:
        return [_refuse(flag, "the interleaved pipeline schedule runs on megapost's native engine only "
                        "(DeepSpeed's PipelineEngine runs 1F1B): add --use-distributed-optimizer")]
    if virtual < 1 or pp < 2:
        return [_refuse(flag, f"needs >= 1 layers and --pipeline-model-parallel-size > 1 (got {pp})")]
    if args.num_layers % (pp * virtual):
        return [_refuse(flag, f"--num-layers {args.num_layers} is not a multiple of "
                        f"--pipeline-model-parallel-size {pp} x {virtual}")]
    return []


def apply_distributed_optimizer(args: argparse.Namespace) -> list[str]:
    """``--use-distributed-optimizer`` runs megapost's native engine (megapost.native: its own distributed
    optimizer, no DeepSpeed); --zero-stage keeps 1, the stage whose memory the native engine's is."""
    if not args.use_distributed_optimizer:
        return []
    if "zero_stage" in args.explicit and args.zero_stage == 0:
        raise _refuse("--use-distributed-optimizer", "conflicts with --zero-stage 0")
    if "zero_stage" not in args.explicit:
        args.zero_stage = 1
    return ["--use-distributed-optimizer -> megapost's distributed optimizer (the native engine, no "
            "DeepSpeed)"]


def _apply_schedule(args: argparse.Namespace) -> None:
    """Sample-based lengths become iterations (Megatron: samples // global batch, no ramp-up)."""
    if args.train_samples is not None:
        if "train_iters" in args.explicit:
            raise _refuse("--train-samples", "give --train-iters or --train-samples, not both")
        args.train_iters = _samples_to_iters(args, args.train_samples, "--train-samples")
        if "lr_decay_iters" not in args.explicit and args.lr_decay_samples is None:
            args.lr_decay_iters = args.train_iters
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters(args, args.lr_decay_samples, "--lr-decay-samples")
    if args.lr_warmup_samples is not None:
        args.lr_warmup_iters = _samples_to_iters(args, args.lr_warmup_samples, "--lr-warmup-samples")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction <= 1:
            raise _refuse(f"--lr-warmup-fraction {args.lr_warmup_fraction}", "must be in [0, 1]")
        args.lr_warmup_iters = int(math.floor(args.lr_warmup_fraction * args.lr_decay_iters))
    if args.lr_wsd_decay_samples is not None:
        args.lr_wsd_decay_iters = _samples_to_iters(args, args.lr_wsd_decay_samples, "--lr-wsd-decay-samples")
    if args.lr_decay_style == "WSD":
        if not args.lr_wsd_decay_iters:
            raise _refuse("--lr-decay-style WSD", "needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        span = args.lr_decay_iters - args.lr_warmup_iters
        if args.lr_wsd_decay_iters > span:
            raise _refuse(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters}",
                          f"exceeds the {span} post-warmup decay iterations")


def _apply_recompute(args: argparse.Namespace) -> list[str]:
    granularity = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    if granularity == "selective":
        return ["selective recompute (fused SDPA stores no attention matrix, so nothing to recompute)"]
    if granularity != "full":
        if args.recompute_method or args.recompute_num_layers:
            raise _refuse("--recompute-method/--recompute-num-layers", "need --recompute-granularity full")
        return []
    method, n = args.recompute_method or "uniform", args.recompute_num_layers or 1
    if n < 1:
        raise _refuse(f"--recompute-num-layers {n}", "must be >= 1")
    per_stage = args.num_layers // max(1, args.pipeline_model_parallel_size)
    if method == "block" and n < per_stage:
        raise _refuse(f"--recompute-method block --recompute-num-layers {n}", "recomputing only some "
                      "layers of a stage is not supported; use --recompute-method uniform (or block with "
                      f"--recompute-num-layers {per_stage}, every layer of a stage)")
    args.checkpoint_activations = True
    args.checkpoint_num_layers = n if method == "uniform" else 1
    return [f"--recompute-granularity full -> --checkpoint-activations --checkpoint-num-layers "
            f"{args.checkpoint_num_layers}"]
