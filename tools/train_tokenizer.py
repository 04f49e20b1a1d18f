"""Moved into the package: the console script `megapost-train-tokenizer` (megapost/data/commands.py). This
path keeps working and runs the same command."""

import sys

from megapost.data.commands import train_tokenizer_main as main

if __name__ == "__main__":
    sys.exit(main())
