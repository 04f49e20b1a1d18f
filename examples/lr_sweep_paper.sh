#!/usr/bin/env bash
# The paper's learning-rate sweep (Section 4 / Appendix F.4-F.5) with the paper-180m preset:
# 48 x 512 Llama (d_ff 1536, 4 heads), seq 2048, batch 256 (micro 4 x accumulation over ranks),
# AdamW (0.9, 0.95), wd 0.1, cosine, 2000 warmup of 40000 steps, clip 1.0, bf16, paper init variances.
#
# Compute (per run; the preset's 32000-token vocabulary, 196.4M parameters untied):
#   tokens  = 40000 steps x 256 sequences x 2048 = 20.97e9
#   FLOPs   = 6 N tokens + attention = 6 x 196.4e6 x 20.97e9 + 6 x 48 x 2048 x 512 x 20.97e9
#           = 2.47e19 + 0.63e19 ~= 2.9e19   (ModelConfig.flops_per_token: 1.38 GFLOP per token)
#   H100/H200 SXM bf16 dense peak ~989 TFLOP/s: at 25% MFU 32.6 GPU-hours, at 40% MFU 20.3 GPU-hours
#   (~4 h / ~2.5 h wall on one 8-GPU node). Five learning rates: ~100-165 GPU-hours; add as much
#   again for the matched Pre-Norm runs (NORMS="post pre"). Collapsing runs (lr >= 8e-4) show their
#   transition by step ~3500 (paper: 2644, 3123, 1699, 1754), so STOP_AT=5000 cuts those to ~1/8.
# Memory (estimate): weights+Adam ~3 GB, bf16 activations of micro-batch 4 x 2048 ~15-20 GB per GPU.
#
# Usage (from the repository root, on each node's shared filesystem):
#   DATA=/data/c4/c4_en_text_document TOKENIZER=/data/llama2/tokenizer.model \
#       bash examples/lr_sweep_paper.sh
#   NUM_GPUS=8 HOSTFILE=hostfile NORMS="post pre" LRS="8e-4 1.2e-3" bash examples/lr_sweep_paper.sh
# Each run writes runs/paper_lr<lr>_<norm>/{tensorboard,checkpoints}; afterwards
#   python tools/plot_collapse.py --run-dir runs/paper_lr8e-4_post/tensorboard --out runs/paper_lr8e-4_post/figures
#   python tools/frequency_loss.py --data-path "$DATA" --tokenizer-model "$TOKENIZER" --tokens 500000000
set -euo pipefail

: "${DATA:?set DATA to the C4 indexed-dataset prefix (tools/preprocess_data.py output)}"
: "${TOKENIZER:?set TOKENIZER to the SentencePiece model used to preprocess DATA}"
LRS=${LRS:-"6e-4 8e-4 1.2e-3 1.5e-3 1.8e-3"}
NORMS=${NORMS:-"post"}
NUM_GPUS=${NUM_GPUS:-8}
RUN_ROOT=${RUN_ROOT:-runs}
COLLAPSE_INTERVAL=${COLLAPSE_INTERVAL:-10}  # metrics every 10 steps (Fig 5 wants every step around the transition)
STOP_AT=${STOP_AT:-40000}
if [[ -z "${MASTER_PORT:-}" ]]; then  # none given: a free one on this node (printed)
  MASTER_PORT=$(python -m megapost.utils.ports)
  echo "MASTER_PORT not set: using free port $MASTER_PORT (set MASTER_PORT to choose one)"
fi
LAUNCHER=(deepspeed --num_gpus "$NUM_GPUS" --master_port "$MASTER_PORT")
[[ -n "${HOSTFILE:-}" ]] && LAUNCHER=(deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT")

for norm in $NORMS; do
  for lr in $LRS; do
    run="$RUN_ROOT/paper_lr${lr}_${norm}"
    echo "=== $run"
    "${LAUNCHER[@]}" --module megapost.pretrain \
      --preset paper-180m --norm-position "$norm" --lr "$lr" --min-lr 0 --lr-warmup-iters 2000 \
      --train-iters "$STOP_AT" --lr-decay-iters 40000 \
      --data-path "$DATA" --tokenizer-model "$TOKENIZER" \
      --tensorboard-dir "$run/tensorboard" --save "$run/checkpoints" \
      --plugins collapse_metrics --collapse-interval "$COLLAPSE_INTERVAL" "$@"
  done
done
