"""More Megatron-LM flags (those of its current ``examples/llama`` scripts), the placement a Megatron
command line means, and the one-line start-up description of placement and init.

Each flag is wired, refused in one line, or listed once at start-up with what megapost does instead
(see DEVELOPERS.md's flag rule). Megatron's own models are Pre-Norm: a command line that uses
Megatron's model flags and leaves out ``--norm-position`` gets Pre-Norm, said at start-up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megapost.config.errors import ConfigError

# Megatron model-architecture flags: one of them typed, without --norm-position, means Megatron's Pre-Norm.
MODEL_MARKERS = (
    "--use-mcore-models", "--swiglu", "--normalization", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--position-embedding-type", "--use-rotary-position-embeddings",
    "--rotary-base", "--rotary-percent", "--norm-epsilon", "--kv-channels", "--max-position-embeddings",
    "--group-query-attention", "--apply-layernorm-1p", "--attention-backend", "--transformer-impl",
    "--qk-layernorm", "--no-position-embedding",
)

# store_true flags that change nothing here: flag -> why (listed at start-up).
NOTED: dict[str, str] = {
    "--apply-layernorm-1p": "zero-centred norm gains (g = 1 + w): the same training here, since norm gains "
                            "get no weight decay and Adam sees the same gradient for w as for g",
    "--cross-entropy-loss-fusion": "the loss is megapost's blocked fp32 cross-entropy, fused with the head "
                                   "at TP 1 in bf16 (--kernel-fusion ce, on under auto)",
    "--no-create-attention-mask-in-dataloader": "no mask is ever built: SDPA's causal flag",
    "--log-validation-ppl-to-tensorboard": "valid/ppl is always written to TensorBoard",
    "--calculate-per-token-loss": "every micro-batch has the same token count (no loss mask), so the "
                                  "per-token mean equals the mean of micro-batch means",
    "--no-mmap-bin-files": "the .bin is memory-mapped (read-only; the page cache is shared by the ranks)",
    "--profile": "no profiler is run: --profile-step-start/--profile-step-end are ignored; use "
                 "torch.profiler yourself",
}
REFUSED: dict[str, str] = {
    "decoupled_lr": "a separate embedding/output lr is not supported; drop --decoupled-lr/--decoupled-min-lr "
                    "(every parameter follows --lr)",
    "decoupled_min_lr": "a separate embedding/output lr is not supported; drop --decoupled-lr/"
                        "--decoupled-min-lr (every parameter follows --min-lr)",
    "fp8_format": "fp8 is not supported; use --bf16 (or fp32)",
    "mock_data": "mock data is not supported; give --data-path (tools/prepare_default_data.py builds one)",
}
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def add_habit_arguments(g: argparse._ArgumentGroup, parser: argparse.ArgumentParser) -> None:
    """The flags above, in the Megatron-LM compatibility group."""
    for flag, why in NOTED.items():
        g.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for dest in REFUSED:
        g.add_argument("--" + dest.replace("_", "-"), dest=dest, help="refused: " + REFUSED[dest])
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="accepted: attention is torch SDPA, which picks its kernel (flash/efficient/math)")
    g.add_argument("--manual-gc", action="store_true", default=None,
                   help="Python's automatic gc off; collect at start and every --manual-gc-interval steps "
                   f"(default on a CUDA device, every {GPU_GC_INTERVAL} iterations)")
    g.add_argument("--no-manual-gc", dest="manual_gc", action="store_false",
                   help="keep Python's automatic gc (also on a CUDA device)")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="0: only at start (as Megatron's)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="accepted (megapost does not collect around validation)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events queued before the TensorBoard writer flushes (SummaryWriter max_queue)")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="accepted: megapost logs the step time only (level 0); no per-operation timers")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="accepted: the CUDA caching allocator is left alone (no empty_cache per step)")
    g.add_argument("--profile-step-start", type=int, default=10, help="see --profile")
    g.add_argument("--profile-step-end", type=int, default=12, help="see --profile")
    if "--grad-reduce-in-bf16" not in parser._option_string_actions:  # wired by the overlap work (#19)
        g.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="accepted: gradients are reduced as DeepSpeed does under --bf16")
        parser.set_defaults(grad_reduce_noted=True)


GPU_GC_INTERVAL = 200


def _cuda() -> bool:
    """Whether this run trains on CUDA (a CUDA device and DeepSpeed's accelerator not set to another)."""
    import os

    import torch

    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"


def apply_habits(args: argparse.Namespace) -> list[str]:
    """Refuse what megapost lacks; return the start-up notes of the rest."""
    for dest, why in REFUSED.items():
        value = getattr(args, dest, None)
        if value is not None:
            raise ConfigError(f"--{dest.replace('_', '-')} {value}: {why}")
    notes = [f"{flag} ({why})" for flag, why in NOTED.items() if getattr(args, flag[2:].replace("-", "_"))]
    if args.attention_backend:
        notes.append(f"--attention-backend {args.attention_backend} (attention is torch SDPA, which picks "
                     "its own kernel)")
    if args.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval {args.manual_gc_interval}: must be >= 0")
    if args.manual_gc is None:  # a CUDA run: every rank pauses for gc at the same step, not at random
        args.manual_gc = _cuda()
        if args.manual_gc:
            if "manual_gc_interval" not in args.explicit:
                args.manual_gc_interval = GPU_GC_INTERVAL
            notes.append(f"Python's gc managed on the GPU (as --manual-gc --manual-gc-interval "
                         f"{args.manual_gc_interval}; --no-manual-gc keeps the automatic gc)")
    elif args.manual_gc is False:
        notes.append("--no-manual-gc (Python's automatic gc kept, also on a CUDA device)")
    elif args.manual_gc:
        every = f"every {args.manual_gc_interval} iterations" if args.manual_gc_interval else "never again"
        notes.append(f"--manual-gc (automatic gc off; collected at start, then {every})")
    if "tensorboard_queue_size" in args.explicit:
        if args.tensorboard_queue_size < 1:
            raise ConfigError(f"--tensorboard-queue-size {args.tensorboard_queue_size}: must be >= 1")
        notes.append(f"--tensorboard-queue-size {args.tensorboard_queue_size} (TensorBoard writer queue)")
    if "manual_gc_eval" in args.explicit:
        notes.append("--no-manual-gc-eval (megapost does not collect around validation)")
    for dest in ("profile_step_start", "profile_step_end"):
        if dest in args.explicit:
            notes.append(f"--{dest.replace('_', '-')} {getattr(args, dest)} (no profiler is run; use "
                         "torch.profiler yourself)")
    if "timing_log_level" in args.explicit:
        notes.append(f"--timing-log-level {args.timing_log_level} (only the step time is logged)")
    if "empty_unused_memory_level" in args.explicit:
        notes.append(f"--empty-unused-memory-level {args.empty_unused_memory_level} (the CUDA caching "
                     "allocator is left alone)")
    if getattr(args, "grad_reduce_in_bf16", False) and getattr(args, "grad_reduce_noted", False):
        notes.append("--grad-reduce-in-bf16 (gradients are reduced as DeepSpeed does under --bf16)")
    if args.vocab_size and args.tokenizer_type != "NullTokenizer":
        notes.append(f"--vocab-size {args.vocab_size} (only NullTokenizer uses it: the embedding is the "
                     "tokenizer's vocabulary padded to --make-vocab-size-divisible-by)")
    return notes


def typed_markers(argv: Sequence[str]) -> list[str]:
    """The Megatron model flags in ``argv`` (``--flag`` or ``--flag=value``)."""
    typed = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    return [f for f in MODEL_MARKERS if f in typed]


def resolve_norm_position(args: argparse.Namespace, argv: Sequence[str]) -> str | None:
    """``--norm-position`` not typed: Pre-Norm for a Megatron command line, else megapost's Post-Norm.
    Returns the start-up note of a Megatron-implied choice."""
    if args.norm_position is not None:
        return None
    markers = typed_markers(argv)
    if not markers:
        args.norm_position = "post"
        return None
    args.norm_position = "pre"
    shown = ", ".join(markers[:3]) + (", ..." if len(markers) > 3 else "")
    return (f"Megatron model flags ({shown}) and no --norm-position: Pre-Norm, as Megatron's models "
            "(--norm-position post trains the study's Post-Norm)")


# Megatron spellings of megapost's own flags, and Megatron's sample counts that become iterations.
ALIASES = {"--norm-epsilon": ("norm_eps", "--norm-eps"), "--rotary-base": ("rope_theta", "--rope-theta"),
           "--data-cache-path": ("data_cache_dir", "--data-cache-dir"),
           "--qk-layernorm": ("qk_norm", "--qk-norm")}
SAMPLES = {"train_samples": "train_iters", "lr_decay_samples": "lr_decay_iters",
           "lr_warmup_samples": "lr_warmup_iters", "lr_wsd_decay_samples": "lr_wsd_decay_iters"}


def mapped_note(args: argparse.Namespace, argv: Sequence[str]) -> str | None:
    """The start-up line of the Megatron flags mapped onto megapost's (after apply_megatron_arguments):
    ``mapped --rotary-base 1e+06 -> --rope-theta, --train-samples 16 -> --train-iters 4``."""
    typed = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    parts = [f"{flag} {getattr(args, dest)} -> {ours}" for flag, (dest, ours) in ALIASES.items()
             if flag in typed]
    parts += [f"--{k.replace('_', '-')} {getattr(args, k)} -> --{v.replace('_', '-')} {getattr(args, v)}"
              for k, v in SAMPLES.items() if getattr(args, k, None) is not None]
    if getattr(args, "lr_warmup_fraction", None) is not None:
        parts.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} -> --lr-warmup-iters "
                     f"{args.lr_warmup_iters}")
    return "mapped " + ", ".join(parts) if parts else None


def typed_init_wins(args: argparse.Namespace) -> str | None:
    """A typed ``--init-method-std`` under a preset's paper init: the typed std wins (init std)."""
    if "init_method_std" in args.explicit and "init_variance" not in args.explicit \
            and args.init_variance != "std":
        args.init_variance = "std"
        return (f"--init-method-std {args.init_method_std:g} typed: --init-variance std (the preset's "
                "paper init would ignore it; pass --init-variance paper to keep that)")
    return None


def init_summary(args: argparse.Namespace) -> str:
    """``init std 0.02 (W_O, W_2 / sqrt(2L))`` or ``init paper (1/(3d), W_2 1/(3 d_ff))``."""
    if args.init_variance == "paper":
        text = "init paper N(0, 1/(3d)), W_2 N(0, 1/(3 d_ff))"
    else:
        text = f"init std {args.init_method_std:g}" + (" (W_O, W_2 / sqrt(2L))" if args.scaled_output_init
                                                       else "")
    mult = getattr(args, "init_sublayer_multiplier", 1.0)
    return text + (f" x{mult:g} variance" if mult != 1.0 else "")
