#!/usr/bin/env bash
# The trigger experiment (issue 40 item 5; docs/study_results.md "The trigger experiment"): when is a
# Post-Norm run's delayed collapse decided, what separates the continuations that collapse, and which
# intervention from there rescues them. Base run: E1's lr 0.019 seed 3 (64 x 4, 256 tokens/step, warmup
# 500, constant lr; it collapses at step 1025). In-memory rollback snapshots at SNAPSHOTS; from each,
# REPLICAS continuations that differ only in their data window after the snapshot (replica r: the base's
# data position + r x 4,000 samples; replica 0 is the base), each to step END (P(collapse by END - 100)).
# Then the interventions (lr x 0.1 on the top 2 layers' W_O; Adam eps 1e-6; norm gains frozen) from
# INTERVENE_AT over the same replicas (paired with their controls). Two niced processes (controls,
# interventions), each one trainer process running its replicas in a loop; resumable (a rerun replays
# only what has no record). On 2 shared CPU cores: ~25 min for the controls, ~15 min for the interventions.
#
#   OUT=/work/study_runs/trigger DATA=/work/study_data bash examples/trigger_experiment.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/trigger}
DATA=${DATA:-$OUT/data}
SNAPSHOTS=${SNAPSHOTS:-500,700,850,950,1000}
REPLICAS=${REPLICAS:-12}
END=${END:-1300}
INTERVENE_AT=${INTERVENE_AT:-1000}
KEEP=${KEEP:-study/results/trigger}
export OMP_NUM_THREADS=1

if [ ! -f "$DATA/bpe2048/news2048_text_document.idx" ]; then  # the study's corpus (examples/law_experiments.sh)
  python tools/prepare_default_data.py --data-dir "$DATA" >/dev/null
  python tools/train_tokenizer.py --input "$DATA/news/*.json.gz" --vocab-size 2048 --output-prefix "$DATA/bpe2048/bpe2048"
  python tools/preprocess_data.py --input "$DATA/news/*.json.gz" --output-prefix "$DATA/bpe2048/news2048" \
    --tokenizer-model "$DATA/bpe2048/bpe2048.model" --append-eod --workers 1
fi
common=(--data-path "$DATA/bpe2048/news2048_text_document" --tokenizer-model "$DATA/bpe2048/bpe2048.model"
        --lr 0.019 --seed 3 --replicas "$REPLICAS" --end-step "$END" --nice 15)
python tools/trigger_experiment.py run --out "$OUT/controls" --snapshots "$SNAPSHOTS" "${common[@]}" \
  > "$OUT.controls.log" 2>&1 &
controls=$!
python tools/trigger_experiment.py run --out "$OUT/interventions" --snapshots "$INTERVENE_AT" \
  --intervene-at "$INTERVENE_AT" --skip-controls "${common[@]}" > "$OUT.interventions.log" 2>&1 &
interventions=$!
wait "$controls" "$interventions"
python tools/trigger_experiment.py report "$OUT/controls" "$OUT/interventions" --keep "$KEEP"
