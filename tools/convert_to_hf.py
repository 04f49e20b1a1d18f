"""Moved into the package: the console script `megapost-export-hf` (megapost/checkpoint/hf_command.py).
This path keeps working and runs the same command."""

from megapost.checkpoint.hf_command import export_hf_main as main

if __name__ == "__main__":
    main()
