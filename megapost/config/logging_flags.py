"""Megatron-LM's logging flags (``--log-params-norm``, ``--log-num-zeros-in-grad``, the
``--log-*-to-tensorboard`` family, ``--tensorboard-log-interval``) with Megatron's meaning.

Wired (megapost.train.logger writes them, computed on logging steps only):
  * ``--log-params-norm``: the L2 norm of all parameters after the step, over the fp32 master weights
    (what the optimizer steps; under --bf16 DeepSpeed's fp32 partitions), each element counted once
    (tensor-parallel replicas once, ZeRO partitions summed over data-parallel ranks), as Megatron-LM's
    ``calc_params_l2_norm``; ``params_norm`` in the log line and TensorBoard.
  * ``--log-num-zeros-in-grad``: the number of exactly-zero elements of the reduced fp32 gradient the
    optimizer applies, each element counted once, as Megatron-LM's ``count_zeros_fp32``; ``num_zeros``.
  * ``--tensorboard-log-interval N``: TensorBoard scalars of the iterations that are multiples of N.
  * ``--no-log-learnig-rate-to-tensorboard`` (Megatron's spelling; ``learning`` also accepted),
    ``--no-log-gradient-norm-to-tensorboard``: those scalars left out of TensorBoard.
  * ``--log-batch-size-to-tensorboard``, ``--log-world-size-to-tensorboard``: ``train/batch_size``,
    ``train/world_size``.
  * ``--wandb-project P`` (with ``--wandb-exp-name``, ``--wandb-save-dir``): the same scalars the console
    and TensorBoard get (megapost.metrics.monitor) also logged to Weights & Biases when ``wandb`` is
    importable (WANDB_MODE=offline honoured: wandb reads it); without ``wandb``, a start-up note says
    nothing is logged there. wandb is not a dependency.
Noted at start-up: ``--log-memory-to-tensorboard`` (memory is always written), ``--no-log-loss-scale-
to-tensorboard`` (no loss scale: bf16/fp32 train without one); ``--log-timers-to-tensorboard`` and
``--log-validation-ppl-to-tensorboard`` are noted by megatron_flags/megatron_habits.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from megapost.config.errors import ConfigError

NOTED = {
    "log_memory_to_tensorboard": "--log-memory-to-tensorboard (memory is always written: "
                                 "throughput/memory_gb)",
    "log_loss_scale_to_tensorboard": "--no-log-loss-scale-to-tensorboard (bf16 and fp32 train without a "
                                     "loss scale; none is written)",
}


def add_logging_arguments(g: argparse._ArgumentGroup) -> None:
    """The flags above, in the Megatron-LM compatibility group."""
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the fp32 master parameters (on logging steps)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the count of exactly-zero reduced gradient elements (on logging steps)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="TensorBoard gets the scalars of iterations that are multiples of this")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
                   dest="log_learning_rate_to_tensorboard", action="store_false",
                   help="leave train/lr out of TensorBoard (Megatron's spelling)")
    g.add_argument("--no-log-gradient-norm-to-tensorboard", dest="log_gradient_norm_to_tensorboard",
                   action="store_false", help="leave train/grad_norm out of TensorBoard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", help="accepted: no loss scale is written (bf16/fp32)")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="write train/batch_size (the global batch)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write train/world_size")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="accepted: memory is always written (throughput/memory_gb)")
    g.add_argument("--wandb-project", help="Weights & Biases project: scalars also logged there when wandb "
                   "is installed (WANDB_MODE=offline honoured)")
    g.add_argument("--wandb-exp-name", help="the Weights & Biases run name (with --wandb-project)")
    g.add_argument("--wandb-save-dir", help="directory of wandb's local files (default: wandb's own)")


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def _wandb_notes(args: argparse.Namespace) -> list[str]:
    if not args.wandb_project:
        typed = [f for f in ("wandb_exp_name", "wandb_save_dir") if getattr(args, f)]
        return [f"--{f.replace('_', '-')} (no --wandb-project: nothing is logged to Weights & Biases)"
                for f in typed]
    if not wandb_installed():
        return [f"--wandb-project {args.wandb_project}: wandb is not installed, nothing is logged to "
                "Weights & Biases (pip install wandb to log there)"]
    return [f"--wandb-project {args.wandb_project}: scalars also logged to Weights & Biases "
            f"(WANDB_MODE={os.environ.get('WANDB_MODE', 'online')})"]


def check_logging_arguments(args: argparse.Namespace) -> list[str]:
    """Refuse a bad interval; return the start-up notes of the flags that change nothing here."""
    if args.tensorboard_log_interval < 1:
        raise ConfigError(f"--tensorboard-log-interval {args.tensorboard_log_interval}: must be positive")
    notes = []
    if args.log_memory_to_tensorboard:
        notes.append(NOTED["log_memory_to_tensorboard"])
    if not args.log_loss_scale_to_tensorboard:
        notes.append(NOTED["log_loss_scale_to_tensorboard"])
    return notes + _wandb_notes(args)
