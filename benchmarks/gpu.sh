#!/usr/bin/env bash
# One command on a bare GPU machine with a CUDA torch: installs what is missing (from the package index,
# or from wheels/ when offline: `bash benchmarks/gpu.sh --build-wheels` on a networked machine), then
# runs benchmarks/gpu_suite.py: paper-180m bf16 eager and --compile (tokens/s, MFU, peak memory vs the
# planner), 1.3B- and 7B-width slices (seq 4096, GQA 8, with/without activation checkpointing), the
# collapse_metrics overhead at intervals 1 and 10, a host-sync audit, the top kernels and the bare-PyTorch
# step on the same GPU; one JSON (gpu_suite.json) and a short table. About 5 min on one H200.
#
#   bash benchmarks/gpu.sh [--steps 20] [--peak-tflops 989] [--out gpu_suite.json]
#   bash benchmarks/gpu.sh --dry-run        # the whole script on CPU with tiny shapes (CI)
#   bash benchmarks/gpu.sh --build-wheels [--python-version 3.11]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=20 PEAK=0 OUT=gpu_suite.json DRY=0 PYVER=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --peak-tflops) PEAK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --build-wheels) BUILD=1; shift ;;
    --python-version) PYVER=$2; shift 2 ;;
    *) echo "error: benchmarks/gpu.sh: unknown flag $1 (see the header of benchmarks/gpu.sh)" >&2; exit 2 ;;
  esac
done
# Pure-Python or manylinux wheels DeepSpeed and megapost import that a CUDA torch does not bring.
DEPS="hjson msgpack ninja psutil py-cpuinfo pydantic pydantic-core annotated-types typing-extensions
typing-inspection einops tqdm packaging numpy sentencepiece safetensors tensorboard tensorboard-data-server
grpcio protobuf absl-py markdown werkzeug markupsafe six setuptools pillow matplotlib contourpy cycler
fonttools kiwisolver pyparsing python-dateutil"

if [ "$BUILD" = 1 ]; then
  mkdir -p wheels
  DS_BUILD_OPS=0 pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w wheels/
  # shellcheck disable=SC2086
  pip download --only-binary=:all: --no-deps --python-version "$PYVER" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d wheels/ $DEPS
  du -sh wheels/; exit 0
fi

if [ "$DRY" = 0 ]; then
  python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "error: benchmarks/gpu.sh needs a CUDA torch and a GPU (torch.cuda.is_available() is False); --dry-run runs it on CPU")'
fi
if ! python -c 'import deepspeed, matplotlib, tensorboard, sentencepiece, safetensors' 2>/dev/null; then
  if ls wheels/deepspeed-*.whl >/dev/null 2>&1; then  # offline: the carried wheels
    pip install --no-deps --no-index wheels/*.whl
  else  # the package index; DeepSpeed without compiling its ops (megapost uses none)
    DS_BUILD_OPS=0 pip install "deepspeed==0.19.8" matplotlib tensorboard sentencepiece safetensors || {
      echo "error: could not install DeepSpeed from the package index; offline, run 'bash benchmarks/gpu.sh --build-wheels' on a networked machine and carry wheels/" >&2; exit 1; }
  fi
fi
export PYTHONPATH="$PWD:$PWD/plugins:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
  exec python benchmarks/gpu_suite.py --dry-run --out "$OUT"
fi
export DS_ACCELERATOR=cuda
python benchmarks/gpu_suite.py --steps "$STEPS" --peak-tflops "$PEAK" --out "$OUT"
