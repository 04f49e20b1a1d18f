#!/usr/bin/env bash
# Every norm placement and the Post-Norm stabilisers under the same collapsing settings, measured by the
# same plugin, then ONE table (markdown + CSV) and ONE figure (tools/placement_table.py).
#
# Configurations (each run is a tools/stability_sweep.py cell: the real trainer, collapse_metrics, a
# resumable outcome.json judged by collapse_metrics/outcome.py):
#   toy:     examples/collapse_toy.sh's settings: 12 layers, d 64, seq 128, batch 8, paper init, lr 1e-2
#            (cosine to 1e-3) with no warmup, 150 steps, collapse_metrics every 5 steps, seed 1234, on the
#            default corpus.
#   delayed: examples/delayed_collapse.sh's settings (4 layers, lr 3e-2 after a 200-step warmup, 400 steps,
#            2,048-token BPE); it runs that script with the variants added.
# Variants: a placement plus trainer flags joined by "+" (post+qk-norm = --norm-position post --qk-norm).
# Cost on 2 shared CPU cores: ~3.5 min per toy run, 2 at a time (JOBS); see docs/readme/study.md.
#
#   bash examples/placement_study.sh                                  # both configurations
#   DELAYED_VARIANTS= bash examples/placement_study.sh                 # toy only
#   PHASE=1 bash examples/placement_study.sh                          # + an lr x warmup phase diagram
#                                                                      #   per variant (costly: 60 runs)
# Outputs: $OUT.md, $OUT.csv, $OUT.png (default docs/figures/placement_study.*), runs in $RUN_ROOT.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_ROOT=${RUN_ROOT:-runs/placement_study}
OUT=${OUT:-docs/figures/placement_study}
VARIANTS=${VARIANTS:-post,pre,sandwich,deepnorm,mix,hybrid,pre-scaled,dyt,post+qk-norm,post+z-loss=1e-4}
DELAYED_VARIANTS=${DELAYED_VARIANTS-$VARIANTS}  # empty: skip the delayed configuration
JOBS=${JOBS:-2}
LAYERS=${LAYERS:-12}
HIDDEN=${HIDDEN:-64}
SEQ=${SEQ:-128}
BATCH=${BATCH:-8}
ITERS=${ITERS:-150}
LR=${LR:-1e-2}
K=${K:-5}  # --collapse-interval
SEED=${SEED:-1234}
PHASE=${PHASE:-0}  # 1: also the toy settings over PHASE_LRS x PHASE_WARMUPS, one phase diagram per variant
PHASE_LRS=${PHASE_LRS:-3e-3,1e-2,3e-2}
PHASE_WARMUPS=${PHASE_WARMUPS:-0,50}

if [ -z "${DATA:-}" ]; then
  read -r DATA TOKENIZER < <(python - <<'PY'
from megapost.data import prepare_default_data
print(*prepare_default_data(log=None))
PY
  )
fi
toy_sweep() {  # the toy settings; "$@" = --out DIR --lrs .. --warmups ..
  python tools/stability_sweep.py --data-path "$DATA" --tokenizer-model "$TOKENIZER" --depths "$LAYERS" \
    --hidden "$HIDDEN" --seq-length "$SEQ" --batch "$BATCH" --iters "$ITERS" --interval "$K" --seeds "$SEED" \
    --variants "$VARIANTS" --jobs "$JOBS" --nice 0 "$@"
}
toy_sweep --out "$RUN_ROOT/toy" --lrs "$LR" --warmups 0
sweeps=(--sweep "toy=$RUN_ROOT/toy")
if [ -n "$DELAYED_VARIANTS" ]; then
  delayed="$RUN_ROOT/delayed"  # its Post/Pre figures go to $RUN_ROOT/delayed/figures_{post,pre}
  RUN_ROOT="$delayed" FIG_ROOT="$delayed/figures" bash examples/delayed_collapse.sh --variants "$DELAYED_VARIANTS" --jobs "$JOBS"
  sweeps+=(--sweep "delayed=$delayed")
fi
python tools/placement_table.py "${sweeps[@]}" --out "$OUT"
if [ "$PHASE" = 1 ]; then  # writes $RUN_ROOT/phase/phase_L$LAYERS.png
  toy_sweep --out "$RUN_ROOT/phase" --lrs "$PHASE_LRS" --warmups "$PHASE_WARMUPS"
fi
