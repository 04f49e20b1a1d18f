"""Megatron-style command-line flags, presets and up-front validation."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .presets import PRESETS


class ConfigError(SystemExit):
    """A one-line configuration error, raised before any heavy work."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=384)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--norm-position", choices=["post", "pre"], default="post")
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
    g.add_argument("--data-path", help="prefix of a .bin/.idx indexed dataset")
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
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="transformer layers per activation-checkpoint segment")


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
    g.add_argument("--load", help="resume from this checkpoint directory (latest tag)")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of one device for MFU (0: measured bf16/fp32 matmul peak)")
    g.add_argument("--plugins", default="", help="comma-separated plugin names (entry points)")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; values it shares with flags must agree")
    g.add_argument("--deepspeed", action="store_true", help="accepted for launcher compatibility")


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


def build_parser(plugin_classes: Sequence[type] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("megapost-pretrain", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (_model_args, _data_args, _training_args, _parallel_args, _io_args, _run_args):
        add(p)
    for cls in plugin_classes:
        cls.add_arguments(p)
    return p


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Destinations of the flags the user actually typed (presets must not override them)."""
    typed = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    return {a.dest for a in parser._actions if typed.intersection(a.option_strings)}


def parse_args(argv: Sequence[str], plugin_classes: Sequence[type] = ()) -> argparse.Namespace:
    parser = build_parser(plugin_classes)
    args = parser.parse_args(list(argv))
    args.explicit = explicit_dests(parser, argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            if key not in args.explicit:
                setattr(args, key, value)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Checks that need no data or model: batch arithmetic, layout, paths."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks"
        )
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
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
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if not args.tokenizer_model:
        raise ConfigError("--tokenizer-model is required (tools/prepare_default_data.py builds the default)")
    if not os.path.isfile(args.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file")
    if not args.data_path:
        raise ConfigError("--data-path is required (a .bin/.idx prefix from tools/preprocess_data.py)")
    for ext in (".bin", ".idx"):
        if not os.path.isfile(args.data_path + ext):
            raise ConfigError(
                f"--data-path {args.data_path}: {args.data_path + ext} not found; build it with "
                "tools/preprocess_data.py (or tools/prepare_default_data.py)"
            )
    if args.load and not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory")
