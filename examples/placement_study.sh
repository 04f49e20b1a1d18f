#!/usr/bin/env bash
# Every norm placement and the Post-Norm stabilisers under the same collapsing settings, measured by the
# same plugin, then ONE table (markdown + CSV) and ONE figure (tools/placement_table.py).
#
# Configurations (each run is a tools/stability_sweep.py cell: the real trainer, collapse_metrics, a
# resumable outcome.json judged by collapse_metrics/analysis/outcome.py):
#   toy:     examples/collapse_toy.sh's settings: 12 layers, d 64, seq 128, batch 8, paper init, lr 1e-2
#            (cosine to 1e-3) with no warmup, 150 steps, collapse_metrics every 5 steps, seed 1234, on the
#            default corpus.
#   delayed-wW: examples/delayed_collapse.sh's settings (4 layers, lr 3e-2 after a W-step warmup, 400 steps,
#            2,048-token BPE) for W in DELAYED_WARMUPS (default 200 = that script's, and 100); it runs that
#            script with the variants added (the toy variables above do not reach it).
# Variants: a placement plus trainer flags joined by "+" (post+qk-norm = --norm-position post --qk-norm).
# Cost on 2 shared CPU cores: ~5 min per toy run, ~40 s per delayed run, 2 at a time (JOBS); the whole
# study (10 variants x 3 configurations) ~30 min; see docs/readme/study.md.
#
#   bash examples/placement_study.sh                    # toy, delayed-w200, delayed-w100
#   DELAYED_VARIANTS= bash examples/placement_study.sh   # toy only
#   PHASE=delayed bash examples/placement_study.sh   # + the delayed settings over PHASE_LRS x PHASE_WARMUPS:
#                                                     # one phase-diagram panel per variant (60 runs, ~22 min;
#                                                     # PHASE=toy: the toy settings, ~2.5 h on 2 shared cores)
# Outputs: $OUT.md, $OUT.csv, $OUT.png (default $RUN_ROOT/placement_study.*), runs in $RUN_ROOT.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_ROOT=${RUN_ROOT:-runs/placement_study}
OUT=${OUT:-$RUN_ROOT/placement_study}  # OUT=docs/figures/placement_study refreshes the tracked ones
VARIANTS=${VARIANTS:-post,pre,sandwich,deepnorm,mix,hybrid,pre-scaled,dyt,post+qk-norm,post+z-loss=1e-4}
DELAYED_VARIANTS=${DELAYED_VARIANTS-$VARIANTS}  # empty: skip the delayed configurations
DELAYED_WARMUPS=${DELAYED_WARMUPS:-200,100}
DELAYED_SEED=${DELAYED_SEED:-4}  # the seed docs/placement_comparison.md's table was measured at
JOBS=${JOBS:-2}
source examples/toy_settings.sh
PHASE=${PHASE:-}  # toy or delayed: that configuration over PHASE_LRS x PHASE_WARMUPS too (off: costly)
PHASE_LRS=${PHASE_LRS:-1e-2,3e-2,1e-1}
PHASE_WARMUPS=${PHASE_WARMUPS:-0,100}
case "$PHASE" in toy | delayed | "") ;; *) echo "error: PHASE=$PHASE: use toy, delayed or leave it empty" >&2; exit 2 ;; esac

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
delayed_sweep() {  # delayed_collapse.sh's settings; "$1" = its RUN_ROOT, "$2" = its WARMUP, then sweep flags
  local root=$1 warmup=$2
  shift 2  # its Post/Pre figures go to $root/figures_{post,pre}
  env -u LAYERS -u LR -u ITERS SEED="$DELAYED_SEED" RUN_ROOT="$root" FIG_ROOT="$root/figures" WARMUP="$warmup" \
    bash examples/delayed_collapse.sh --variants "$DELAYED_VARIANTS" --jobs "$JOBS" "$@"
}
for w in ${DELAYED_WARMUPS//,/ }; do
  [ -n "$DELAYED_VARIANTS" ] || break
  delayed_sweep "$RUN_ROOT/delayed_w$w" "$w"
  sweeps+=(--sweep "delayed-w$w=$RUN_ROOT/delayed_w$w")
done
python tools/placement_table.py "${sweeps[@]}" --out "$OUT"
case "$PHASE" in  # the sweep writes $RUN_ROOT/phase_$PHASE/phase_L<depth>.png
  toy) toy_sweep --out "$RUN_ROOT/phase_toy" --lrs "$PHASE_LRS" --warmups "$PHASE_WARMUPS" ;;
  delayed) delayed_sweep "$RUN_ROOT/phase_delayed" 200 --lrs "$PHASE_LRS" --warmups "$PHASE_WARMUPS" ;;
esac
