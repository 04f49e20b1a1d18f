#!/usr/bin/env bash
# A Post-Norm run that first learns and then collapses, beside its Pre-Norm twin (identical settings).
# Found by tools/stability_sweep.py (docs/readme/collapse.md): 4 layers, d=64, seq 64, batch 8, paper
# init, lr 3e-2 after a 100-step linear warmup (cosine to 3e-3), 400 steps, on the embedded news corpus
# tokenized with a 2,048-token BPE trained on it (frequency loss of the train split: 6.50 nats).
# Measured (seed 1, metrics every 4 steps): Post-Norm falls to 6.06 (0.44 nats below the frequency
# loss) by step ~80, then, as the lr reaches its peak, t_sim(X^H) rises 0.3 -> 1.0 (steps 100-136) and
# the loss climbs back to the frequency loss (6.4-6.6) and stays there; the first/last-layer gradient
# ratio decays from ~1 to 1e-2..7e-4. Pre-Norm keeps training (5.6-6.0, t_sim 0.25).
# ~10 min per run on 2 idle CPU cores.
#
#   bash examples/delayed_collapse.sh                 # both runs, then figures
#   WARMUP=200 LR=3e-2 bash examples/delayed_collapse.sh
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_ROOT=${RUN_ROOT:-runs/delayed_collapse}
FIG_ROOT=${FIG_ROOT:-docs/figures/delayed_collapse}
LAYERS=${LAYERS:-4}
LR=${LR:-3e-2}
WARMUP=${WARMUP:-100}
ITERS=${ITERS:-400}
SEED=${SEED:-1}
DATA_DIR=${DATA_DIR:-data/bpe2k}

python tools/prepare_default_data.py >/dev/null
if [ ! -f "$DATA_DIR/news2k_text_document.idx" ]; then
  python tools/train_tokenizer.py --input 'data/news/*.json.gz' --vocab-size 2048 --output-prefix "$DATA_DIR/bpe2k"
  python tools/preprocess_data.py --input 'data/news/*.json.gz' --output-prefix "$DATA_DIR/news2k" \
    --tokenizer-model "$DATA_DIR/bpe2k.model" --append-eod --workers 1
fi
python tools/stability_sweep.py --out "$RUN_ROOT" --data-path "$DATA_DIR/news2k_text_document" \
  --tokenizer-model "$DATA_DIR/bpe2k.model" --depths "$LAYERS" --lrs "$LR" --warmups "$WARMUP" \
  --seeds "$SEED" --iters "$ITERS" --interval 4 --nice 0 "$@"
lr_name=$(python -c "print('%g' % float('$LR'))")  # the sweep names cells with %g
for norm in post pre; do
  run="$RUN_ROOT/cells/${norm}_L${LAYERS}_lr${lr_name}_w${WARMUP}_s${SEED}"
  python tools/plot_collapse.py --run-dir "$run/tensorboard" --out "${FIG_ROOT}_$norm" --window 40
done
