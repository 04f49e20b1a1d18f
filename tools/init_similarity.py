"""Stage I at initialisation (Figs 1, 2): measured vs predicted one-step token-similarity increments.

    python tools/init_similarity.py --out runs/init_similarity --figure-dir docs/figures \\
        --multipliers 0.5,1,2,4 --prefix-alpha-sweep 0,0.25,0.5,0.75,1

Writes <out>/init_similarity_{post,pre}.json (every number; nan as null) and, in --figure-dir (default
--out), fig1_init_similarity_{post,pre}.png and fig2_prefix_alpha.png. Forward only, one sequence at a
time, fp32 unless --bf16 (bf16 shifts Post-Norm's small norm step noticeably: use fp32 for figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from collapse_metrics.analysis.figures import plot_init_similarity, plot_prefix_alpha
from collapse_metrics.analysis.stage1 import run_placement, write_json

from megapost.data import SentencePieceTokenizer, prepare_default_data
from megapost.model import ModelConfig
from megapost.parallel.layout import padded_vocab_size
from megapost.train.plugin_services import InitModels


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", help="indexed dataset prefix (default: the embedded news corpus)")
    p.add_argument("--tokenizer-model", help="SentencePiece model (default: the embedded corpus's)")
    p.add_argument("--num-layers", type=int, default=48)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-sequences", type=int, default=2)
    p.add_argument("--norms", default="post,pre",
                   help="norm placements to measure (any --norm-position; the theory exists for post, pre)")
    p.add_argument("--multipliers", type=floats, default=floats("0.5,1,2,4"),
                   help="sublayer init-variance multipliers (Fig 1 sweep)")
    p.add_argument("--prefix-alpha-sweep", type=floats, default=[], help="alphas for Fig 2 (multiplier 1)")
    p.add_argument("--alpha-norms", default="post", help="placements that get the alpha sweep")
    p.add_argument("--init-variance", choices=("paper", "std"), default="paper")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234, help="model init seed")
    p.add_argument("--data-seed", type=int, default=1234, help="which sequences are drawn")
    p.add_argument("--bf16", action="store_true", help="bf16 weights/activations (t_sim still fp32)")
    p.add_argument("--out", default="runs/init_similarity")
    p.add_argument("--figure-dir", default=None, help="where the PNGs go (default: --out)")
    p.add_argument("--replot", action="store_true", help="only redraw the figures from <out>/*.json")
    return p.parse_args(argv)


def replot(args: argparse.Namespace) -> int:
    out, figs = Path(args.out), Path(args.figure_dir or args.out)
    results = {}
    for norm in [v.strip() for v in args.norms.split(",") if v.strip()]:
        results[norm] = json.loads((out / f"init_similarity_{norm}.json").read_text())
        plot_init_similarity(results[norm], figs / f"fig1_init_similarity_{norm}.png")
    if any(r.get("prefix_alpha_sweep") for r in results.values()):
        plot_prefix_alpha(results, figs / "fig2_prefix_alpha.png")
    print(f"redrew figures in {figs}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    data_path, tokenizer_model = args.data_path, args.tokenizer_model
    if data_path is None or tokenizer_model is None:
        default_prefix, default_tok = prepare_default_data(log=None)
        data_path, tokenizer_model = data_path or default_prefix, tokenizer_model or default_tok
    vocab = padded_vocab_size(SentencePieceTokenizer(tokenizer_model).vocab_size,
                              args.make_vocab_size_divisible_by)
    models = InitModels()
    tokens = models.sequences(data_path, args.seq_length, args.num_sequences, args.data_seed)
    base = ModelConfig(vocab_size=vocab, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                       seq_length=args.seq_length, init_variance=args.init_variance, seed=args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    out, figs = Path(args.out), Path(args.figure_dir or args.out)
    results = {}
    for norm in [v.strip() for v in args.norms.split(",") if v.strip()]:
        start = time.perf_counter()
        alphas = args.prefix_alpha_sweep if norm in args.alpha_norms.split(",") else []
        cfg = dataclasses.replace(base, norm_position=norm)
        res = run_placement(cfg, tokens, args.multipliers, alphas, dtype, models=models)
        res["data_path"], res["data_seed"] = data_path, args.data_seed
        res["wall_s"] = time.perf_counter() - start
        results[norm] = res
        write_json(out / f"init_similarity_{norm}.json", res)
        plot_init_similarity(res, figs / f"fig1_init_similarity_{norm}.png")
        print_summary(norm, res)
    if args.prefix_alpha_sweep:
        plot_prefix_alpha(results, figs / "fig2_prefix_alpha.png")
    print(f"wrote {out}/init_similarity_*.json and figures in {figs}")
    return 0


def print_summary(norm: str, res: dict) -> None:
    """Measured / predicted increment per layer band and multiplier; alpha sweep shares removed."""
    print(f"{norm}-norm ({res['wall_s']:.0f} s): sum(measured)/sum(predicted) per layer band")
    if any(run["band_ratios"] is None for run in res["runs"]):
        print("  no closed form for this placement (docs/placements.md): measured increments only")
        return
    for run in res["runs"]:
        for sub in ("attn", "ffn"):
            bands = "  ".join(f"{b['layers'][0]}-{b['layers'][1]}: {b['ratio']:.2f}"
                              for b in run["band_ratios"][sub])
            print(f"  x{run['multiplier']:<4g} {sub:4s} {bands}")
    for alpha, share in res.get("prefix_alpha_removed", {}).items():
        print(f"  alpha {alpha}: removes {100 * share:.1f}% of the summed attention increment")


if __name__ == "__main__":
    sys.exit(main())
