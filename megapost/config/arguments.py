"""Megatron-style command-line flags, presets and up-front validation."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from megapost.config.errors import ConfigError, Errors
from megapost.config.parser import OneLineParser, parse_collecting
from megapost.config.presets import PRESETS
from megapost.model.fusion import parse_fusion
from megapost.model.placements import PLACEMENTS

OPTIMIZERS = ("adam", "sgd")  # Megatron-LM's --optimizer values


def _two_floats(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers, got {text!r}")
    return float(parts[0]), float(parts[1])


def _fusion_spec(text: str) -> str:
    try:
        parse_fusion(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kernel-fusion: ")) from None
    return text


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=384)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int,
                   help="grouped-query attention: K/V heads (must divide the heads; default: one per head)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Megatron's switch for --num-query-groups (which alone is enough here)")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--norm-position", choices=list(PLACEMENTS),
                   help="norm placement (docs/placements.md): post, pre, sandwich (Peri-LN), deepnorm, "
                        "mix (Mix-LN), hybrid (HybridNorm), pre-scaled (LayerNorm Scaling), dyt (DyT); "
                        "default post, but pre with Megatron's model flags (--swiglu, ...), as Megatron")
    g.add_argument("--mix-post-fraction", type=float, default=0.25,
                   help="mix: the first floor(rho * layers) layers Post-Norm, the rest Pre-Norm")
    g.add_argument("--dyt-alpha-init", type=_two_floats, default=(0.8, 0.2), metavar="ATTN,OTHER",
                   help="dyt: initial tanh scale of the attention DyT and of the FFN/final DyT")
    g.add_argument("--qk-norm", action="store_true",
                   help="RMSNorm of queries and keys per head (one gain shared by the heads), before RoPE")
    g.add_argument("--norm-eps", type=float, default=1e-5)
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g.add_argument("--init-variance", choices=["std", "paper"], default="std",
                   help="std: N(0, init-method-std^2); paper: 1/(3d), W_2 1/(3 d_ff)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--no-scaled-output-init", dest="scaled_output_init", action="store_false",
                   help="disable Megatron's std/sqrt(2L) for W_O and W_2")
    g.add_argument("--init-sublayer-multiplier", type=float, default=1.0,
                   help="multiplies the init variance of every attention/FFN matrix (sweeps)")
    g.add_argument("--prefix-alpha", type=float, default=0.0,
                   help="attention output minus alpha * causal running mean of V (Corollary 3.3)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+",
                   help="prefix of a .bin/.idx dataset, or a blend: [weight] prefix [weight] prefix ...")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights over documents")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file")
    g.add_argument("--data-cache-dir", help="where index .npy caches go (default: beside the data)")


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a named recipe")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant", "WSD"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", default="adam",
                   help="adam: AdamW (torch's fused kernel); sgd: torch SGD with --sgd-momentum (Megatron's)")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum of --optimizer sgd")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--z-loss", type=float, default=0.0, metavar="COEF",
                   help="PaLM's auxiliary COEF * log^2 Z per token (e.g. 1e-4), in the gradient only: "
                        "lm_loss stays the cross-entropy")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--no-bf16", "--fp32", dest="bf16", action="store_false", default=argparse.SUPPRESS,
                   help="train in fp32 even when --preset turns bf16 on")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="transformer layers per activation-checkpoint segment")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (steps with collapse_metrics probes run "
                        "eager); slower than eager on an H200 at paper-180m so far (docs/kernels.md)")
    g.add_argument("--kernel-fusion", type=_fusion_spec, default="auto", metavar="auto|none|LIST",
                   help="fused kernels (docs/kernels.md): auto = those bit-identical in fp32 always, packed "
                        "QKV and W1/W3 GEMMs and the chunked head + loss when not fp32; none; or a comma "
                        "list of rope, qkv, w13, swiglu, grad-accum, norm, ce")
    g.add_argument("--no-triton-kernels", dest="triton_kernels", action="store_false",
                   help="on CUDA, run the norm, rope and swiglu fusions as torch ops, not as their Triton "
                        "kernels (docs/kernels.md)")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl on GPU")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a rank that dies makes the others fail after this long instead of hanging")
    g.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))


def _io_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--load", help="resume from this checkpoint directory (latest tag), saved at any layout")
    g.add_argument("--load-hf", help="start from the weights of a Hugging Face Llama directory "
                   "or a megapost export (safetensors); fills the model flags from its config.json")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of one device for MFU (0: the datasheet table for known GPUs, "
                   "else a measured matmul peak cached per machine)")
    g.add_argument("--plugins", default="", help="comma-separated plugin names (entry points)")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; values it shares with flags must agree")
    g.add_argument("--deepspeed", action="store_true", help="accepted for launcher compatibility")


def _trust_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data identity and MFU peak")
    g.add_argument("--override-data", action="store_true",
                   help="resume a run on other data/tokenizer flags than it was trained with (noted)")
    g.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="train although --data-path's .tokenizer.json names another tokenizer (a warning)")
    g.add_argument("--remeasure-peak", action="store_true",
                   help="re-measure the CPU matmul peak for MFU instead of reusing ~/.cache/megapost")


def _checkpoint_safety_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint safety")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="DANGEROUS: unpickle --load files without megapost's allowlist (weights_only=False); "
                        "a crafted checkpoint then runs arbitrary code. Only for files you wrote yourself")


# flags that must be >= 1, and flags that must be >= 0 (0 switches the feature off)
_POSITIVE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "global_batch_size", "train_iters", "log_interval", "checkpoint_num_layers",
             "tensor_model_parallel_size", "pipeline_model_parallel_size")
_NON_NEGATIVE = ("save_interval", "eval_interval", "eval_iters", "lr_warmup_iters", "lr_decay_iters")


def check_counts(args: argparse.Namespace) -> None:
    """Counts and sizes must be positive (intervals may be 0 for off); every bad one reported."""
    typed, derived = Errors(), Errors()  # a derived value (--lr-decay-iters = --train-iters) only alone
    for dest, least in [(d, 1) for d in _POSITIVE] + [(d, 0) for d in _NON_NEGATIVE]:
        value = getattr(args, dest, None)
        if value is not None and value < least:
            kind = "positive" if least else "0 (off) or positive"
            error = ConfigError(f"--{dest.replace('_', '-')} {value}: must be {kind}")
            (typed if dest in getattr(args, "explicit", ()) else derived).add(error)
    typed.raise_all()
    derived.raise_all()


def _validate_tokenizer(args: argparse.Namespace) -> None:
    kind = getattr(args, "tokenizer_type", "SentencePieceTokenizer")
    if kind == "NullTokenizer":
        return
    if not args.tokenizer_model:
        raise ConfigError("--tokenizer-model is required (tools/prepare_default_data.py builds the default)")
    if kind == "HuggingFaceTokenizer":
        if not os.path.isdir(args.tokenizer_model):
            raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: --tokenizer-type "
                              "HuggingFaceTokenizer needs a local tokenizer directory")
    elif not os.path.isfile(args.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file")


def _validate_data(args: argparse.Namespace) -> None:
    """Every prefix of every source exists; ``args.data_sources`` holds them, ``args.data_path`` the first."""
    from megapost.data.blend import sources_from_args
    from megapost.data.errors import DataError

    try:
        args.data_sources = sources_from_args(args)
    except DataError as e:
        raise ConfigError(str(e)) from None
    prefixes = args.data_sources.prefixes
    if not prefixes:
        raise ConfigError("--data-path is required (a .bin/.idx prefix from megapost-preprocess), "
                          "or --train-data-path/--valid-data-path/--test-data-path")
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(
                    f"--data-path {prefix}: {prefix + ext} not found; build it with "
                    "megapost-preprocess (or megapost-prepare-data)"
                )
    args.data_path = prefixes[0]


def _run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run directories and exits")
    g.add_argument("--runs-dir", help="parent of run directories <runs-dir>/<run-name>/{tensorboard,"
                   "checkpoints} (default: 'runs' with --run-name; the example scripts pass <repo>/runs)")
    g.add_argument("--run-name", help="this run's directory under --runs-dir; a run of that name with a "
                   "checkpoint is resumed (default: <norm>norm-<YYYYmmdd-HHMMSS>, a new directory)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT save a checkpoint at the next step boundary and exit 0")
    g.add_argument("--exit-interval", type=int, default=0,
                   help="save a checkpoint and exit 0 when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=0.0,
                   help="save a checkpoint and exit 0 at the first step boundary after this many minutes")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=10,
                   help="a step with a non-finite gradient norm is skipped (weights, optimizer state and "
                        "lr schedule unchanged) and counted; stop after this many in a row (checked at log "
                        "steps)")
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                   help="iterations whose batches are consumed without a step (Megatron-LM's meaning), "
                        "e.g. to step over a bad batch on a resume")


def build_parser(plugin_classes: Sequence[type] = ()) -> argparse.ArgumentParser:
    p = OneLineParser("megapost-pretrain", description=__doc__,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (_model_args, _data_args, _training_args, _parallel_args, _io_args, _trust_args,
                _checkpoint_safety_args, _run_args):
        add(p)
    from megapost.config.megatron_flags import add_megatron_arguments

    add_megatron_arguments(p)
    from megapost.config.checkpoint_flags import add_checkpoint_arguments

    add_checkpoint_arguments(p)
    for cls in plugin_classes:
        cls.add_arguments(p)
    return p


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Destinations of the flags the user actually typed (presets must not override them)."""
    typed = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    return {a.dest for a in parser._actions if typed.intersection(a.option_strings)}


def parse_with_preset(parser: argparse.ArgumentParser, argv: Sequence[str],
                      errors: Errors | None = None) -> argparse.Namespace:
    """Parse, then fill every flag the user did not type from ``--preset`` (typed flags win). With
    ``errors``, every flag error is kept there and the rest of ``argv`` parsed (else the first raises)."""
    if errors is None:
        args = parser.parse_args(list(argv))
    else:
        args, argv = parse_collecting(parser, argv, errors)  # type: ignore[arg-type]
    args.explicit = explicit_dests(parser, argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            if key not in args.explicit:
                setattr(args, key, value)
    return args


def parse_args(argv: Sequence[str], plugin_classes: Sequence[type] = (),
               errors: Errors | None = None) -> argparse.Namespace:
    """Parse and check the flags; every error of them raised together (one line each), or kept in
    ``errors`` for the caller to add its own checks' errors and raise them all."""
    collect = errors if errors is not None else Errors()
    args = parse_with_preset(build_parser(plugin_classes), argv, collect)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    from megapost.config.checkpoint_flags import check_checkpoint_arguments
    from megapost.config.megatron_flags import apply_megatron_arguments
    from megapost.config.megatron_habits import mapped_note, resolve_norm_position, typed_init_wins

    implied = [resolve_norm_position(args, argv), typed_init_wins(args)]
    args.megatron_notes, args.start_notes = [], []
    with collect:
        args.megatron_notes = apply_megatron_arguments(args)  # printed as "accepted ..."
    with collect:
        args.megatron_notes += check_checkpoint_arguments(args)
    args.start_notes = [n for n in (*implied, mapped_note(args, argv)) if n]  # printed as they are
    if errors is None:
        collect.raise_all()
    return args


def _check_query_groups(args: argparse.Namespace, tp: int) -> None:
    heads, groups = args.num_attention_heads, args.num_query_groups
    if args.group_query_attention and groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups G (the number of K/V heads)")
    if groups is None:
        return
    if groups < 1 or heads % groups:
        raise ConfigError(f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
    if groups % tp and tp % groups:
        raise ConfigError(f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must "
                          "divide the other (K/V heads are split over TP ranks, or replicated when fewer)")


def _check_layout(args: argparse.Namespace, world_size: int) -> None:
    """World size / TP x PP, the batch arithmetic over data-parallel ranks, ZeRO under PP."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks"
        )
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    if args.micro_batch_size < 1:
        return  # said by check_counts
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}; pick a multiple of "
            f"{args.micro_batch_size * dp}"
        )
    args.grad_accum_steps = args.global_batch_size // (args.micro_batch_size * dp)
    if pp > 1 and args.zero_stage == 0 and "zero_stage" not in args.explicit:
        args.zero_stage = 1  # DeepSpeed's pipeline engine clips correctly only with ZeRO-1 in fp32
    if args.zero_stage >= 2 and pp > 1:
        raise ConfigError(
            f"--zero-stage {args.zero_stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's "
            "pipeline engine supports ZeRO stage 0 or 1 only; use --zero-stage 1"
        )


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Checks that need no data or model: batch arithmetic, layout, paths; every failing check's error
    raised together (one line each)."""
    errors = Errors()
    with errors:
        check_counts(args)
    with errors:
        _check_layout(args, world_size)
    tp = args.tensor_model_parallel_size
    with errors:
        _check_query_groups(args, max(1, tp))
    if args.optimizer not in OPTIMIZERS:
        errors.add(ConfigError(f"--optimizer {args.optimizer}: megapost supports adam (AdamW) or sgd"))
    if args.sequence_parallel and tp == 1:  # as Megatron: nothing to split the sequence over
        args.sequence_parallel = False
        args.megatron_notes = [*getattr(args, "megatron_notes", []),
                               "--sequence-parallel (off: --tensor-model-parallel-size is 1, as Megatron)"]
    with errors:
        _validate_tokenizer(args)
    with errors:
        _validate_data(args)
    if args.max_consecutive_skipped_iterations < 1:
        n = args.max_consecutive_skipped_iterations
        errors.add(ConfigError(f"--max-consecutive-skipped-iterations {n}: must be >= 1"))
    if any(i < 1 for i in args.iterations_to_skip):
        errors.add(ConfigError(f"--iterations-to-skip {' '.join(map(str, args.iterations_to_skip))}: "
                               "iterations count from 1"))
    if args.load and args.load_hf:
        errors.add(ConfigError("--load and --load-hf both given; --load resumes a run, --load-hf starts one"))
    if args.load and not os.path.isdir(args.load):
        errors.add(ConfigError(f"--load {args.load}: no such checkpoint directory"))
    errors.raise_all()
