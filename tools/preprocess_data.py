"""Moved into the package: the console script `megapost-preprocess` (megapost/data/commands.py). This
path keeps working and runs the same command."""

import sys

from megapost.data.commands import preprocess_main as main

if __name__ == "__main__":
    sys.exit(main())
