#!/usr/bin/env bash
# One command on a bare GPU machine: finds python3, uses the active venv (or conda env), or python3 when
# it already imports a CUDA torch, or creates .venv-gpu (seeing python3's packages), installs what is
# missing -- torch (the CUDA build from the package index), DeepSpeed and the rest (or from wheels/
# when offline: `bash benchmarks/gpu.sh --build-wheels` on a networked machine), megapost itself
# (`pip install -e .` of this clone, which registers the collapse_metrics plugin) -- then runs
# benchmarks/gpu_suite.py, every case in a fresh process: paper-180m bf16 eager, --compile and CUDA-graphed
# at micro 4 x 8 and at the planner's recommended micro-batch (per-step times, tokens/s, MFU, kernels per
# step, device-busy fraction, peak memory vs the planner), the collapse_metrics overhead at intervals 1
# and 10, the real command (examples/pretrain_postnorm.sh) against the benchmark, the Hugging Face Llama
# peer, 1.3B- and 7B-width slices (with/without activation checkpointing), a host-sync audit, the top
# kernels and --async-save. A failing case is a row with its error; the JSON (gpu_suite.json) is
# rewritten after every case; no case starts past --budget-s (default 300 s a call). The must-show rows
# come in two calls, --part 1 then --part 2 (benchmarks/suite_plan.py: the split and each case's
# estimate; the suite prints its planned schedule first and exits 1 when a part's sum passes the budget);
# --part extra runs the rest on time left. Not yet run on a GPU: the JSON records the suite's own wall
# time, suite_wall_s, and each case's, case_wall_s.
#
#   bash benchmarks/gpu.sh [--part 1|2|extra|all] [--steps 10] [--budget-s 300] [--peak-tflops 989]
#                          [--out gpu_suite.json] [--venv DIR]
#   bash benchmarks/gpu.sh --dry-run        # the whole script on CPU with tiny shapes (CI); CPU torch
#   bash benchmarks/gpu.sh --print-python   # the interpreter it would use (creating .venv-gpu if needed)
#   bash benchmarks/gpu.sh --build-wheels [--python-version 3.11]
# Environment: PYTHON (the interpreter to start from), TORCH (the torch requirement to install).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=10 BUDGET=300 PEAK=0 OUT=gpu_suite.json DRY=0 WHICH=0 BUILD=0 PYVER="" VENV=.venv-gpu SUITE_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --peak-tflops) PEAK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --venv) VENV=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --print-python) WHICH=1; shift ;;
    --inject-failure) SUITE_ARGS+=(--inject-failure "$2"); shift 2 ;;
    --part) SUITE_ARGS+=(--part "$2"); shift 2 ;;
    --build-wheels) BUILD=1; shift ;;
    --python-version) PYVER=$2; shift 2 ;;
    *) echo "error: benchmarks/gpu.sh: unknown flag $1 (see the header of benchmarks/gpu.sh)" >&2; exit 2 ;;
  esac
done
say() { echo "gpu.sh: $*"; }
die() { echo "error: benchmarks/gpu.sh: $*" >&2; exit 1; }

# 1. An interpreter: $PYTHON, the active venv/conda env, else python3 itself when it already imports a
#    CUDA torch (the dry run: any torch and DeepSpeed) -- an image's venv python3 on PATH with
#    VIRTUAL_ENV unset is common -- else .venv-gpu created from python3, seeing python3's packages
#    (--system-site-packages shows only the *base* interpreter's when python3 is itself a venv, so a
#    .pth lists python3's own site-packages too). Never a bare `python`.
ready() {  # $1 imports what this run needs from a torch already there
  if [ "$DRY" = 1 ]; then "$1" -c 'import torch, deepspeed' 2>/dev/null
  else "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; fi
}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY=$VIRTUAL_ENV/bin/python
elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then PY=$CONDA_PREFIX/bin/python
else
  command -v python3 >/dev/null || die "no python3 on PATH; install Python >= 3.10 or set PYTHON=/path/to/python3"
  if ready python3; then
    PY=$(command -v python3); say "python3 ($PY) already has the torch this run needs: using it"
  else
    if [ ! -x "$VENV/bin/python" ]; then
      say "creating $VENV (python3 -m venv --system-site-packages, seeing python3's own packages)"
      python3 -m venv --system-site-packages "$VENV" ||
        die "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv), or activate a venv first"
      SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      python3 -c 'import site, sys; print("\n".join(site.getsitepackages()))' > "$SITE/_parent_env.pth"
    fi
    PY=$VENV/bin/python
  fi
fi
command -v "$PY" >/dev/null || die "$PY (the interpreter chosen: \$PYTHON, the venv or conda env) is not executable"
if [ "$WHICH" = 1 ]; then echo "$PY"; exit 0; fi
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' ||
  die "$PY is Python $("$PY" -V 2>&1); megapost needs >= 3.10 (set PYTHON=/path/to/python3.11)"
"$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade >/dev/null ||
  die "$PY has no pip and ensurepip failed; install pip for it (apt-get install python3-pip)"
PIP=("$PY" -m pip install --disable-pip-version-check --retries 0 --timeout 5)  # offline: fail at once
[ -n "$PYVER" ] || PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
say "python $PY ($("$PY" -V 2>&1))"

# DeepSpeed and what megapost imports, pinned to the versions the suite passed with (datasets included).
PINS=benchmarks/gpu_wheels.txt
if [ "$BUILD" = 1 ]; then
  mkdir -p wheels
  DS_BUILD_OPS=0 "$PY" -m pip wheel "$(grep '^deepspeed==' "$PINS")" --no-deps --no-build-isolation -w wheels/
  "$PY" -m pip download --only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d wheels/ \
    -r <(grep -v -e '^#' -e '^deepspeed==' "$PINS")
  du -sh wheels/; exit 0
fi

# 2. torch: a GPU machine usually has a CUDA one; else the index's default Linux build (CUDA). The dry
#    run takes the CPU build (never a multi-GB CUDA download): torch==2.13.0+cpu from the configured
#    index or find-links, else from download.pytorch.org's CPU index.
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if [ "$DRY" = 1 ]; then
    T=${TORCH:-torch==2.13.0+cpu}; say "installing $T (CPU build, for the dry run)"
    "${PIP[@]}" "$T" || "${PIP[@]}" "$T" --index-url https://download.pytorch.org/whl/cpu ||
      die "could not install $T; set TORCH= to a CPU torch requirement or install one"
  else
    T=${TORCH:-torch}; say "installing $T (the CUDA build the package index serves for Linux)"
    "${PIP[@]}" -q "$T" 2>/dev/null || die "could not install $T into $PY (offline or PIP_NO_INDEX?); install a CUDA torch, or point PYTHON= at an interpreter that has one, and rerun"
  fi
fi
if [ "$DRY" = 0 ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "error: benchmarks/gpu.sh needs a CUDA torch and a GPU (torch.cuda.is_available() is False); --dry-run runs it on CPU")'
fi

# 3. DeepSpeed, the libraries megapost imports and transformers (the HF peer row).
if ! "$PY" -c 'import deepspeed, matplotlib, tensorboard, sentencepiece, safetensors, datasets, transformers' 2>/dev/null; then
  if ls wheels/deepspeed-*.whl >/dev/null 2>&1; then  # offline: the carried wheels, resolved (pip checks them)
    "${PIP[@]}" --no-index --find-links wheels/ -r "$PINS"
  else  # the package index; DeepSpeed without compiling its ops (megapost uses none)
    DS_BUILD_OPS=0 "${PIP[@]}" -r "$PINS" || die \
      "could not install DeepSpeed from the package index; offline, run 'bash benchmarks/gpu.sh --build-wheels' on a networked machine and carry wheels/"
  fi
fi

# 4. megapost itself, from this clone: the collapse_metrics plugin is found only through its entry point.
installed() {
  env -u PYTHONPATH "$PY" - "$PWD" <<'EOF' 2>/dev/null
import importlib.metadata as md, os, sys
import megapost, collapse_metrics
here = os.path.realpath(sys.argv[1]) + os.sep
ok = all(os.path.realpath(m.__file__).startswith(here) for m in (megapost, collapse_metrics))
sys.exit(0 if ok and any(e.name == "collapse_metrics" for e in md.entry_points(group="megapost.plugins")) else 1)
EOF
}
if ! installed; then
  say "installing megapost from $PWD (pip install -e . --no-deps)"
  "${PIP[@]}" --no-deps --no-build-isolation -e . >/dev/null 2>&1 || "${PIP[@]}" --no-deps -e . >/dev/null ||
    die "pip install -e . failed in $PWD (needs setuptools >= 64: $PY -m pip install setuptools)"
  installed || die "megapost installed but not importable from $PWD with its collapse_metrics entry point"
fi

# 5. The suite: each case on its own; a case that kills the process becomes a row, the rest still run.
export PYTHONPATH="$PWD:$PWD/plugins:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
  SUITE_ARGS+=(--dry-run)
else
  export DS_ACCELERATOR=cuda
  SUITE_ARGS+=(--steps "$STEPS" --peak-tflops "$PEAK" --budget-s "$BUDGET")
fi
rm -f "$OUT"
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  [ "$attempt" = 1 ] && RESUME=() || RESUME=(--resume)
  rc=0; "$PY" benchmarks/gpu_suite.py "${SUITE_ARGS[@]}" --out "$OUT" "${RESUME[@]}" || rc=$?
  [ "$rc" = 0 ] && exit 0
  [ -f "$OUT" ] || die "benchmarks/gpu_suite.py failed before its first case (exit $rc, output above)"
  say "the suite process died (exit $rc); restarting after the case it died in"
done
die "the suite died 10 times; $OUT holds the rows it finished"
