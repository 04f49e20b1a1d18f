"""``python -m megapost.plan --preset llama-7b --gpus 64 --gpu-memory-gb 80 [--json]``.

Takes every model and batch flag of ``megapost.pretrain`` (a preset, then typed flags win), plus the
cluster: GPUs, GPUs per node, memory per GPU, peak TFLOP/s and the MFU to predict speed at.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence

from megapost.config.arguments import build_parser, parse_with_preset
from megapost.config.errors import ConfigError
from megapost.config.megatron_flags import apply_distributed_optimizer
from megapost.config.megatron_habits import resolve_norm_position
from megapost.model import ModelConfig
from megapost.plan import precision_from_ds_config
from megapost.plan.collapse_risk import collapse_risk, delayed_collapse_risk
from megapost.plan.counts import parameter_counts
from megapost.plan.memory import async_save_host_bytes
from megapost.plan.search import Candidate, candidates, rank_key, recommend
from megapost.plan.throughput import Cluster
from megapost.plan.verdict import verdict
from megapost.study.boundary_law import load_law, run_factors

GiB = 2**30
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers")
DEFAULT_PEAK_TFLOPS = 989.0  # H100 SXM bf16 dense
DEFAULT_PEAK_NAME = "H100 SXM bf16 dense"
SPEED_FLAGS = (  # the speed model's Cluster fields a flag sets (megapost/plan/throughput.py)
    ("mfu_half_tokens", int, "tokens per micro-batch at which MFU reaches half of --mfu"),
    ("intra_node_gbs", float, "GB/s per GPU inside a node (NVLink)"),
    ("inter_node_gbs", float, "GB/s per GPU between nodes (the network)"),
)
TIE = 0.005  # layouts predicted within 0.5 % of the fastest are reported as tied
DIST_OPT_NOTE = ("--use-distributed-optimizer: priced as what the trainer runs under it, megapost's native "
                 "engine (megapost/native: one reduce-scatter per step overlapped with the last backward, "
                 "the weight gather with the next forward; ~0.6x ZeRO-1's bytes in bf16); under PP its "
                 "1F1B or the interleaved schedule (PPxvN: N virtual stages per rank, "
                 "--num-layers-per-virtual-pipeline-stage L/(PP N)) (docs/multi-gpu.md)")


DEFAULT_VOCAB = 32000  # --vocab-size (the trainer's flag: the tokenizer vocabulary, padded as it does)

def _parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog, p.description = "python -m megapost.plan", __doc__
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, default=None,
                   help="GPUs to lay out (without it: the model's counts and the collapse-risk lines only)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node")
    g.add_argument("--gpu-memory-gb", type=float, default=80.0, help="per GPU, GiB")
    g.add_argument("--memory-margin", type=float, default=0.10,
                   help="fraction of GPU memory kept free (CUDA context, NCCL, allocator fragmentation)")
    g.add_argument("--mfu", type=float, default=0.4,
                   help="model FLOP utilisation of a large micro-batch (it saturates: docs/scaling.md)")
    for field, kind, text in SPEED_FLAGS:
        g.add_argument(f"--{field.replace('_', '-')}", type=kind, default=getattr(Cluster, field), help=text)
    g.add_argument("--norm-kernel", choices=["fused", "apex"], default="fused",
                   help="RMSNorm on the GPUs: torch's fused kernel, or apex's FusedRMSNorm when installed")
    g.add_argument("--top", type=int, default=12, help="fitting layouts listed")
    g.add_argument("--json", action="store_true", help="print everything as JSON")
    g.add_argument("--collapse-law", "--collapse-boundary", dest="collapse_law", metavar="FILE", default=None,
                   help="collapse-law fit of megapost-law boundary for the collapse-risk line (default: "
                   "$MEGAPOST_COLLAPSE_LAW, runs/collapse_law/law.json, else the shipped CPU fit)")
    g.add_argument("--hazard-law", metavar="FILE", default=None,
                   help="delayed-collapse (hazard) law of megapost-law fit for the delayed-collapse line "
                   "(default: the shipped megapost/study/hazard_law_post.json)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    args = parse_with_preset(_parser(), argv)
    args.fp32 = "bf16" in args.explicit and not args.bf16  # --no-bf16 / --fp32 (the trainer's flag)
    resolve_norm_position(args, argv)  # the trainer's default: Pre-Norm for Megatron model flags
    if apply_distributed_optimizer(args):  # the trainer's ZeRO stage for it: a layout constraint
        args.explicit.add("zero_stage")
    if (args.gpus is not None and args.gpus < 1) or args.gpu_memory_gb <= 0 or not 0 < args.mfu <= 1:
        raise ConfigError("--gpus must be >= 1, --gpu-memory-gb > 0 and --mfu in (0, 1]")
    if args.mfu_half_tokens < 0 or args.intra_node_gbs <= 0 or args.inter_node_gbs <= 0:
        raise ConfigError("--mfu-half-tokens must be >= 0 and --intra-node-gbs, --inter-node-gbs > 0")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The trainer's own ModelConfig for these flags (vocabulary padded as it pads it)."""
    from megapost.config.model_config import model_config_from_args

    try:
        return model_config_from_args(args, args.vocab_size or DEFAULT_VOCAB)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _user_ds_config(args: argparse.Namespace) -> dict:
    """--deepspeed_config's bucket settings change memory; read them as the trainer would."""
    if not args.deepspeed_config:
        return {}
    try:
        with open(args.deepspeed_config) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed_config {args.deepspeed_config}: {e}") from None


def _row(c: Candidate, flops_per_token: float, peak_tflops: float) -> dict[str, object]:
    w = c.worst()
    mfu = c.tokens_per_second * flops_per_token / (c.layout.gpus * peak_tflops * 1e12)
    return {"layout": c.layout.__dict__, "label": c.layout.label(), "fits": c.fits, "peak_gb": c.peak / GiB,
            "worst_stage": w.stage, "memory_gb": {k: getattr(w, k) / GiB for k in COMPONENTS},
            "step_seconds": c.step_seconds, "tokens_per_second": c.tokens_per_second, "mfu": mfu,
            "comm_gb_per_gpu": c.comm_bytes / GiB, "seconds_by_cause": c.time_parts}


# layout flags of the trainer the planner takes as constraints when typed: (dest, Layout field)
CONSTRAINTS = (("zero_stage", "zero_stage"), ("tensor_model_parallel_size", "tp"),
               ("pipeline_model_parallel_size", "pp"), ("sequence_parallel", "sequence_parallel"),
               ("checkpoint_activations", "checkpoint"))


def _allowed(layout: object, args: argparse.Namespace) -> bool:
    """Only layouts that agree with every layout flag the user typed (and the bf16 promotion of
    --zero-stage 0 to 1, as the trainer does)."""
    for dest, field in CONSTRAINTS:
        if dest not in args.explicit:
            continue
        want = getattr(args, dest)
        if dest == "zero_stage" and not args.fp32:
            want = max(1, want)
        if getattr(layout, field) != want:
            return False
    return True


def _model_and_risk(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, object]:
    """What the planner says without a cluster: the model's counts, both collapse-risk records and the one
    verdict line (``megapost.plan.verdict``)."""
    out: dict[str, object] = {
        "model": {"preset": args.preset, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "ffn_hidden_size": cfg.ffn_hidden_size, "heads": cfg.num_attention_heads,
                  "vocab_padded": cfg.vocab_size, "seq_length": cfg.seq_length},
        "parameters": parameter_counts(cfg).as_dict(),
        "flops_per_token": cfg.flops_per_token(),
        "collapse_risk": collapse_risk(*load_law(args.collapse_law), args.norm_position,
                                       run_factors(args, cfg), args.lr),
        "delayed_collapse": delayed_collapse_risk(args, cfg, args.hazard_law),
    }
    out["verdict"] = verdict(out["collapse_risk"], out["delayed_collapse"], args.lr, int(args.train_iters))
    return out


def plan(args: argparse.Namespace) -> dict[str, object]:
    cfg = model_config(args)
    if args.gpus is None:
        return {**_model_and_risk(args, cfg), "cluster": None}
    prec = precision_from_ds_config({**_user_ds_config(args), "bf16": {"enabled": not args.fp32}},
                                    norm_kernel=args.norm_kernel)
    peak = args.peak_tflops or DEFAULT_PEAK_TFLOPS
    peak_source = ("--peak-tflops" if args.peak_tflops
                   else f"default: {DEFAULT_PEAK_NAME}; --peak-tflops to set")
    cluster = Cluster(peak, args.mfu, args.mfu_half_tokens, args.gpus_per_node, args.intra_node_gbs,
                      args.inter_node_gbs)
    cands = candidates(cfg, args.gpus, args.global_batch_size, prec, memory_bytes=args.gpu_memory_gb * GiB,
                       cluster=cluster, margin=args.memory_margin, clip_grad=args.clip_grad,
                       reduce_in_bf16=bool(args.grad_reduce_in_bf16 and not args.fp32),
                       checkpoint_num_layers=args.checkpoint_num_layers,
                       micro_batches=[args.micro_batch_size] if "micro_batch_size" in args.explicit else None,
                       distributed_optimizer=bool(args.use_distributed_optimizer),
                       tp_overlap=getattr(args, "async_tensor_model_parallel_allreduce", True))
    cands = [c for c in cands if _allowed(c.layout, args)]
    best = recommend(cands)
    fitting = sorted((c for c in cands if c.fits), key=rank_key)

    def row(c: Candidate) -> dict[str, object]:
        return _row(c, cfg.flops_per_token(), peak)

    return {
        **_model_and_risk(args, cfg),
        "cluster": {"gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
                    "gpu_memory_gb": args.gpu_memory_gb,
                    "usable_gb": args.gpu_memory_gb * (1 - args.memory_margin), "peak_tflops": peak,
                    "peak_source": peak_source,
                    "mfu": args.mfu, "mfu_half_tokens": args.mfu_half_tokens,
                    "intra_node_gbs": args.intra_node_gbs, "inter_node_gbs": args.inter_node_gbs,
                    "precision": "fp32" if args.fp32 else "bf16",
                    "global_batch_size": args.global_batch_size},
        "candidates": len(cands), "fitting": [row(c) for c in fitting],
        "not_fitting": [row(c) for c in cands if not c.fits],
        "recommended": row(best) if best else None,
        "ties": sum(1 for c in fitting if c.step_seconds <= best.step_seconds * (1 + TIE)) if best else 0,
        "async_save_host_gb_per_node": (async_save_host_bytes(cfg, best.layout)
                                        * min(args.gpus, args.gpus_per_node) / GiB if best else None),
        "notes": [DIST_OPT_NOTE] if args.use_distributed_optimizer else [],
    }


def _model_lines(result: dict) -> list[str]:
    p, m = result["parameters"], result["model"]
    return [
        f"model: {m['preset'] or 'custom'}  {m['num_layers']} x {m['hidden_size']}, "
        f"ffn {m['ffn_hidden_size']}, "
        f"{m['heads']} heads, vocab {m['vocab_padded']}, seq {m['seq_length']}",
        f"parameters: {p['total'] / 1e9:.3f}B total | embedding {p['embedding'] / 1e6:.1f}M | head "
        f"{p['head'] / 1e6:.1f}M | per layer {p['per_layer'] / 1e6:.2f}M",
        f"FLOPs per token (fwd+bwd): {result['flops_per_token'] / 1e9:.2f} GFLOP",
    ]


def render(result: dict, top: int) -> str:
    m, c = result["model"], result["cluster"]
    if c is None:
        return "\n".join([*_model_lines(result), "layouts: none asked (--gpus N to lay the model out)",
                          result["verdict"]])
    lines = [
        *_model_lines(result),
        f"cluster: {c['gpus']} GPUs ({c['gpus_per_node']}/node), {c['gpu_memory_gb']:.0f} GiB each "
        f"({c['usable_gb']:.1f} usable), {c['precision']}, global batch {c['global_batch_size']} x "
        f"{m['seq_length']}, {c['peak_tflops']:g} TFLOP/s peak ({c['peak_source']})",
        f"speed model: MFU {c['mfu']:.2f} x T/(T + {c['mfu_half_tokens']}) at T tokens per micro-batch, "
        f"links {c['intra_node_gbs']:g} GB/s in a node, {c['inter_node_gbs']:g} between nodes, exposed "
        "communication and the pipeline bubble added (docs/scaling.md)",
        f"{len(result['fitting'])} of {result['candidates']} layouts fit; fastest first "
        "(GiB per GPU, worst stage):",
        f"  {'layout':40s} {'weights':>7s} {'grads':>7s} {'optim':>7s} {'activ':>7s} {'buffers':>7s} "
        f"{'peak':>7s} {'step s':>8s} {'tokens/s':>10s}",
    ]
    for row in result["fitting"][:top]:
        g = row["memory_gb"]
        lines.append(f"  {row['label']:40s} {g['weights']:7.2f} {g['gradients']:7.2f} {g['optimizer']:7.2f} "
                     f"{g['activations']:7.2f} {g['buffers']:7.2f} {row['peak_gb']:7.2f} "
                     f"{row['step_seconds']:8.3g} {row['tokens_per_second']:10.0f}")
    best = result["recommended"]
    if best:
        lines.append(f"recommended: {best['label']} -> {best['peak_gb']:.1f} GiB/GPU, "
                     f"{best['step_seconds']:.3g} s/step, {best['tokens_per_second']:,.0f} tokens/s "
                     f"at MFU {best['mfu']:.2f}")
        if result["ties"] > 1:
            lines.append(f"  {result['ties']} fitting layouts are predicted within {TIE:.1%} of it: the "
                         "model does not rank them")
    else:
        lines.append("recommended: none fits; add GPUs, lower --micro-batch/--seq-length, or use more memory")
    if result["async_save_host_gb_per_node"] is not None:
        lines.append(f"--async-save holds {result['async_save_host_gb_per_node']:.1f} GiB of host memory per "
                     "node (pinned; fp32 master + Adam moments of each rank's shard, one buffer per rank)")
    lines += result["notes"]
    lines.append(result["verdict"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time notices stay off stdout
        result = plan(args)
    print(json.dumps(result, indent=1) if args.json else render(result, args.top))


if __name__ == "__main__":
    main()
