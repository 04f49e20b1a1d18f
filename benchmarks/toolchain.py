"""What ``--compile`` needs besides torch: a C compiler (Triton builds its launcher, Inductor's CPU
backend its kernels) and the Python headers. Checked before a compiled case, so a bare machine gets one
line and a skipped row instead of a traceback minutes into the case."""

from __future__ import annotations

import os
import shutil
import sysconfig


def compile_toolchain_missing() -> str | None:
    """None when ``--compile`` can build its kernels here, else one line saying what is missing."""
    missing = []
    cc = os.environ.get("CC")
    if not (shutil.which(cc) if cc else any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        missing.append(f"a C compiler ({'CC=' + cc if cc else 'cc/gcc/clang'} not found)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        missing.append(f"Python.h (not in {include})")
    if not missing:
        return None
    return (f"--compile needs {' and '.join(missing)}: install a compiler and the Python headers "
            "(Debian/Ubuntu: apt-get install build-essential python3-dev) or set CC")
