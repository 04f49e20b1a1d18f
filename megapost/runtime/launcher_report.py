"""The one-line error as the launcher's failure report shows it.

A rank that fails exits 1 after its one line; what the launcher prints next is its own and cannot be
turned off from the rank (short of exiting 0, which would report success): DeepSpeed's ``launch.py``
adds two lines (``Killing subprocess N``, ``... exits with return code = 1``), torchrun's elastic agent
a traceback of its ``ChildFailedError`` and a failure table, for a ``SystemExit(1)`` as for any other
exit code. Under torchrun the rank also writes its line into the agent's error file
(``TORCHELASTIC_ERROR_FILE``), so the table's root cause is the line itself rather than a link on how
to enable tracebacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from megapost.utils.atomic import atomic_write_text


def record_for_launcher(message: str) -> None:
    """Under torchrun: ``message`` as this rank's root cause in the elastic agent's failure report."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(data))
