"""Console scripts that run a study tool of the source checkout: ``megapost-sweep``
(tools/stability_sweep.py). The study tools import the collapse_metrics plugin and their sibling tools,
so they stay scripts of the checkout that ``pip install -e .`` installs from; without one, one line."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def run_tool(script: str) -> None:
    """``tools/<script>`` as ``python tools/<script>`` runs it, with this process's arguments."""
    path = TOOLS / script
    if not path.is_file():
        sys.exit(f"error: tools/{script} comes with the source checkout: git clone megapost, then "
                 "pip install -e . there")
    sys.argv[0] = str(path)
    sys.path.insert(0, str(TOOLS))
    runpy.run_path(str(path), run_name="__main__")


def sweep() -> None:
    """``megapost-sweep``: the stability sweep (tools/stability_sweep.py)."""
    run_tool("stability_sweep.py")
