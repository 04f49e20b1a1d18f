#!/usr/bin/env bash
# A Post-Norm run that first learns and then collapses, beside its Pre-Norm twin (identical settings).
# Found by tools/stability_sweep.py (docs/collapse_study.md): 4 layers, d=64, seq 64, batch 8, paper
# init, lr 3e-2 after a 200-step linear warmup (cosine to 3e-3), 400 steps, on the embedded news corpus
# tokenized with a 2,048-token BPE trained on it (frequency loss of the train split L = 6.50 nats).
# Measured with the current sample order (seed 4, metrics every 4 steps; seeds 1-6 were tried, 2 of 6
# collapse by step 400: docs/collapse_study.md): Post-Norm learns to 5.71 (trailing 5-step mean, 0.79 nats
# below L, t_sim(X^H) 0.30) by step 148; as the lr nears its peak the loss climbs back (+0.3 by step 176,
# 6.29 at 244) while t_sim(X^H) rises 0.3 -> 0.5 (step 196) -> 0.75 (252), then jumps to 0.97 at step 316
# and stays at 1.000, the loss pinned at L and the first/last-layer gradient ratio down from 1-3 to
# 6e-5..1.4e-3; the alarm prints "[collapse] COLLAPSED at step 328" (default threshold). Pre-Norm keeps
# training (final 5.37, gap -1.13, t_sim 0.18).
# ~40 s per run on 2 shared CPU cores (both runs + figures: 53 s).
# Re-measured over seeds 1-16 with the current code on an AVX-512 CPU (examples/scaling_study.sh, part
# outcomes; docs/collapse_study.md "Scaling the study"): seeds 8, 10, 12 collapse after learning (P = 0.19
# [0.07, 0.43]); seeds 3 and 6, which collapsed in the previous round, now plateau. Which seeds collapse
# moves with the code and the CPU's kernels (~1e-6 loss differences that this edge of stability
# amplifies); the probability is what reproduces. The default seed is 8 (transition 320, alarm 360; its
# Pre-Norm twin trains: final -1.28); the numbers above are seed 4's of an earlier round.
#
# What reproduces is the probability, not one seed's fate: at these settings one seed collapses after
# learning with P = 0.19 [0.07, 0.43] (3/16 seeds), so on another CPU seed 8 most likely (P ~ 0.8) ends
# on the plateau. SEEDS=1,2,...,16 runs them all; the sweep's cells.md prints P(collapsed) and
# P(delayed) with their Wilson intervals (~30 s per run; the figures are drawn for SEED).
#
#   bash examples/delayed_collapse.sh                 # both runs, then figures
#   SEEDS=$(seq -s, 1 16) bash examples/delayed_collapse.sh   # the probability over 16 seeds (cells.md)
#   WARMUP=100 LR=3e-2 bash examples/delayed_collapse.sh
#   SEED=1 bash examples/delayed_collapse.sh          # the seed first published (collapse at 320): now a
#                 plateau (best gap -0.85, final -0.19); not the sample order (same batches), but ~1e-6
#                 loss differences from the first step that this edge of stability amplifies
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_ROOT=${RUN_ROOT:-runs/delayed_collapse}
FIG_ROOT=${FIG_ROOT:-$RUN_ROOT/figures/delayed_collapse}  # FIG_ROOT=docs/figures/delayed_collapse refreshes the tracked ones
LAYERS=${LAYERS:-4}
LR=${LR:-3e-2}
WARMUP=${WARMUP:-200}
ITERS=${ITERS:-400}
SEED=${SEED:-8}
SEEDS=${SEEDS:-$SEED}
DATA_DIR=${DATA_DIR:-data/bpe2k}

python tools/prepare_default_data.py >/dev/null
if [ ! -f "$DATA_DIR/news2k_text_document.idx" ]; then
  python tools/train_tokenizer.py --input 'data/news/*.json.gz' --vocab-size 2048 --output-prefix "$DATA_DIR/bpe2k"
  python tools/preprocess_data.py --input 'data/news/*.json.gz' --output-prefix "$DATA_DIR/news2k" \
    --tokenizer-model "$DATA_DIR/bpe2k.model" --append-eod --workers 1
fi
python tools/stability_sweep.py --out "$RUN_ROOT" --data-path "$DATA_DIR/news2k_text_document" \
  --tokenizer-model "$DATA_DIR/bpe2k.model" --depths "$LAYERS" --lrs "$LR" --warmups "$WARMUP" \
  --seeds "$SEEDS" --iters "$ITERS" --interval 4 --nice 0 "$@"
lr_name=$(python -c "print('%g' % float('$LR'))")  # the sweep names cells with %g
for norm in post pre; do
  run="$RUN_ROOT/cells/${norm}_L${LAYERS}_lr${lr_name}_w${WARMUP}_s${SEED}"
  [ -d "$run/tensorboard" ] || continue  # not among the --variants given
  python tools/plot_collapse.py --run-dir "$run/tensorboard" --out "${FIG_ROOT}_$norm" --window 40
done
