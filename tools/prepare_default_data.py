"""Moved into the package: the console script `megapost-prepare-data` (megapost/data/commands.py). This
path keeps working and runs the same command."""

import sys

from megapost.data.commands import prepare_data_main as main

if __name__ == "__main__":
    sys.exit(main())
