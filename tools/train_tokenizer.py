"""Train a SentencePiece BPE tokenizer on the text of JSON-lines shards.

    python tools/train_tokenizer.py --input 'data/news/*.json.gz' --vocab-size 8000 --output-prefix data/bpe8k
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapost.data import DataError, SentencePieceTokenizer, train_tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_GLOB", help="JSON-lines shards")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--json-key", default="text", help="field holding the text")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to <unk>")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="lines sampled for training")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = train_tokenizer(
            args.input,
            args.output_prefix,
            vocab_size=args.vocab_size,
            json_key=args.json_key,
            model_type=args.model_type,
            byte_fallback=not args.no_byte_fallback,
            max_sentences=args.max_sentences,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (vocab {SentencePieceTokenizer(path).vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
