"""Tokenize JSON-lines shards / HF datasets into Megatron .bin/.idx files.

    python tools/preprocess_data.py --input 'c4/c4-train.0000*-of-01024.json.gz' \
        --output-prefix data/c4 --tokenizer-model data/tokenizer.model --append-eod --workers 4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapost.data import DataError, preprocess


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=[], metavar="PATH_OR_GLOB",
                   help=".json/.jsonl/.json.gz JSON-lines shards, globs, or datasets save_to_disk folders")
    p.add_argument("--hf-dataset", metavar="NAME_OR_PATH", help="a datasets name or folder (loaded locally)")
    p.add_argument("--hf-split", default="train", help="split of --hf-dataset / saved DatasetDicts")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (one output each)")
    p.add_argument("--output-prefix", required=True, help="outputs go to <prefix>_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    p.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed lines")
    p.add_argument("--chunk-size", type=int, default=128, help="documents per work unit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(
            args.input,
            output_prefix=args.output_prefix,
            tokenizer_model=args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            hf_dataset=args.hf_dataset,
            hf_split=args.hf_split,
            chunk_size=args.chunk_size,
            progress=not args.no_progress,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
