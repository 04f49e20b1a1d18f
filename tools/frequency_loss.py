"""Frequency loss (Definition 3.7) of an indexed dataset: L_freq = H(c / N) = -sum_v p_v log p_v, in nats.

    python tools/frequency_loss.py --data-path data/news_text_document \\
        --tokenizer-model data/tokenizer.model --scope tokens --tokens 500000000 --seq-length 2048 \\
        --output runs/freq_loss.json

Scopes (the label collections of the paper's Fig 6): ``sequence`` = one sequence of --seq-length labels,
``batch`` = --batch-size sequences, ``tokens`` = --tokens labels (default: all). Labels are read from
--offset on as one flat stream (memory-mapped, --chunk-tokens at a time, memory O(vocab + chunk)) and
cut into consecutive sequences of --seq-length for the per-sequence value; the aggregated value pools
them all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict

import numpy as np
from collapse_metrics.frequency import streaming_frequency_loss

from megapost.data import IndexedDataset, SentencePieceTokenizer, prepare_default_data
from megapost.utils.atomic import atomic_write_text


def chunks(tokens: np.ndarray, start: int, stop: int, chunk_tokens: int) -> Iterator[np.ndarray]:
    """Consecutive int64 copies of tokens[start:stop], ``chunk_tokens`` at a time."""
    for lo in range(start, stop, chunk_tokens):
        yield np.asarray(tokens[lo : min(lo + chunk_tokens, stop)], dtype=np.int64)


def max_token(tokens: np.ndarray, chunk_tokens: int) -> int:
    """Largest token id, streamed."""
    return max((int(c.max()) for c in chunks(tokens, 0, len(tokens), chunk_tokens) if len(c)), default=0)


def budget(args: argparse.Namespace, available: int) -> int:
    """Labels in the scope, capped by what the data holds after --offset."""
    want = {"sequence": args.seq_length, "batch": args.batch_size * args.seq_length,
            "tokens": args.tokens if args.tokens is not None else available}[args.scope]
    return min(want, available)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", help="indexed dataset prefix (default: the embedded news corpus)")
    p.add_argument("--tokenizer-model", help="gives the vocabulary size (else --vocab-size or the data max)")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--scope", choices=("sequence", "batch", "tokens"), default="tokens")
    p.add_argument("--tokens", type=int, help="label budget of --scope tokens (default: all)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=256, help="sequences in --scope batch")
    p.add_argument("--offset", type=int, default=0, help="first token of the stream")
    p.add_argument("--chunk-tokens", type=int, default=1 << 22)
    p.add_argument("--output", help="JSON file (written atomically)")
    args = p.parse_args(argv)
    if args.tokens is not None and args.scope != "tokens":
        p.error("--tokens applies to --scope tokens only")
    for name in ("seq_length", "batch_size", "chunk_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.data_path is None:
        args.data_path, default_tok = prepare_default_data(log=None)
        args.tokenizer_model = args.tokenizer_model or default_tok
    tokens = IndexedDataset(args.data_path).tokens
    if args.vocab_size is None:
        args.vocab_size = (SentencePieceTokenizer(args.tokenizer_model).vocab_size if args.tokenizer_model
                           else max_token(tokens, args.chunk_tokens) + 1)
    n = budget(args, max(0, len(tokens) - args.offset))
    start = time.perf_counter()
    res = streaming_frequency_loss(chunks(tokens, args.offset, args.offset + n, args.chunk_tokens),
                                   args.vocab_size, seq_len=args.seq_length, max_tokens=n)
    elapsed = time.perf_counter() - start
    report = {**{k: v for k, v in vars(args).items() if k != "output"}, **asdict(res),
              "elapsed_s": elapsed, "tokens_per_s": res.num_tokens / elapsed if elapsed > 0 else None}
    print(f"{args.data_path} [{args.scope}]: {res.num_tokens:,} labels, {res.num_sequences:,} sequences of "
          f"<= {args.seq_length}")
    print(f"  aggregated frequency loss  {res.aggregated:.4f} nats")
    print(f"  per-sequence frequency loss {res.per_sequence:.4f} nats")
    print(f"  {report['tokens_per_s'] or 0:,.0f} tokens/s ({elapsed:.2f} s)")
    if args.output:
        text = json.dumps({k: (None if isinstance(v, float) and v != v else v) for k, v in report.items()})
        atomic_write_text(args.output, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
