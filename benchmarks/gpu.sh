#!/usr/bin/env bash
# One command on a CUDA machine: paper-180m in bf16 (synthetic batches), then the collapse_metrics
# overhead at interval 1 and 100. Works offline: without DeepSpeed it installs the wheels carried in
# wheels/ (--no-deps --no-index; build them on a networked machine with `bash benchmarks/gpu.sh
# --build-wheels`, see docs/scaling.md).
#
#   bash benchmarks/gpu.sh [--steps 300] [--peak-tflops 989] [--overhead-block 100]
#   bash benchmarks/gpu.sh --build-wheels [--python-version 3.11]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=300 PEAK=0 BLOCK=100 PYVER=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --peak-tflops) PEAK=$2; shift 2 ;;
    --overhead-block) BLOCK=$2; shift 2 ;;
    --build-wheels) BUILD=1; shift ;;
    --python-version) PYVER=$2; shift 2 ;;
    *) echo "error: benchmarks/gpu.sh: unknown flag $1 (see the header of benchmarks/gpu.sh)" >&2; exit 2 ;;
  esac
done
# Pure-Python or manylinux wheels DeepSpeed and megapost import that a CUDA torch does not bring.
DEPS="hjson msgpack ninja psutil py-cpuinfo pydantic pydantic-core annotated-types typing-extensions
typing-inspection einops tqdm packaging numpy sentencepiece safetensors tensorboard tensorboard-data-server
grpcio protobuf absl-py markdown werkzeug markupsafe six setuptools pillow"

if [ "$BUILD" = 1 ]; then
  mkdir -p wheels
  DS_BUILD_OPS=0 pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w wheels/
  # shellcheck disable=SC2086
  pip download --only-binary=:all: --no-deps --python-version "$PYVER" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d wheels/ $DEPS
  du -sh wheels/; exit 0
fi

python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "error: benchmarks/gpu.sh needs a CUDA torch and a GPU (torch.cuda.is_available() is False)")'
if ! python -c 'import deepspeed' 2>/dev/null; then
  ls wheels/deepspeed-*.whl >/dev/null 2>&1 || {
    echo "error: DeepSpeed is not installed and wheels/deepspeed-*.whl is missing; run 'bash benchmarks/gpu.sh --build-wheels' on a machine with network and carry wheels/" >&2; exit 1; }
  pip install --no-deps --no-index wheels/*.whl
fi
export PYTHONPATH="$PWD:$PWD/plugins:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR=cuda
python benchmarks/gpu_run.py --steps "$STEPS" --peak-tflops "$PEAK"
if python -c 'import megapost.plan' 2>/dev/null; then
  GB=$(python -c 'import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))')
  echo "planner's prediction (compare with 'peak memory allocated' above):"
  python -m megapost.plan --preset paper-180m --gpus 1 --gpu-memory-gb "$GB" --micro-batch-size 4 || true
fi
python benchmarks/collapse_overhead.py --layers 48 --hidden 512 --seq 2048 --micro 4 --accum 8 --vocab 32000 \
  --block "$BLOCK" --rounds 2 --bf16
