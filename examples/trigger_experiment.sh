#!/usr/bin/env bash
# The trigger experiment (issue 40 item 5; docs/study_results.md "The trigger experiment"): when is a
# Post-Norm run's delayed collapse decided, what separates the continuations that collapse, and which
# intervention from there rescues them. Base run: E1's lr 0.019 seed 3 (64 x 4, 256 tokens/step, warmup
# 500, constant lr; it collapses at step 1025). In-memory rollback snapshots; from each, REPLICAS
# continuations that differ only in their data window after the snapshot (replica r: the base's data
# position + r x 4,000 samples; replica 0 is the base), each to step 1300 (collapse confirmable to 1200).
# Then the interventions from a snapshot over the same replicas (paired with their controls): lr x 0.1 on
# the top 2 layers' W_O (wo_lr0.1), Adam eps 1e-6 (eps1e-6), norm gains frozen (freeze_gains), and lr x 0.1
# on layer 1's W_O (wo1_lr0.1). Each part is one niced trainer process running its replicas in a loop
# (tools/trigger_experiment.py run), two parts at a time; resumable (a rerun replays only what has no
# record). What ran on 2 shared cores on 2026-12-05 (~75 min, load 20-38): every part, with fewer
# replicas where docs/study_results.md says so.
#
#   OUT=/work/study_runs/trigger DATA=/work/study_data bash examples/trigger_experiment.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/trigger}
DATA=${DATA:-$OUT/data}
REPLICAS=${REPLICAS:-12}
KEEP=${KEEP:-study/results/trigger}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"

if [ ! -f "$DATA/bpe2048/news2048_text_document.idx" ]; then  # the study's corpus (examples/law_experiments.sh)
  python tools/prepare_default_data.py --data-dir "$DATA" >/dev/null
  python tools/train_tokenizer.py --input "$DATA/news/*.json.gz" --vocab-size 2048 --output-prefix "$DATA/bpe2048/bpe2048"
  python tools/preprocess_data.py --input "$DATA/news/*.json.gz" --output-prefix "$DATA/bpe2048/news2048" \
    --tokenizer-model "$DATA/bpe2048/bpe2048.model" --append-eod --workers 1
fi

part() {  # part NAME [trigger_experiment.py run flags...]
  local name=$1
  shift
  python tools/trigger_experiment.py run --out "$OUT/$name" --data-path "$DATA/bpe2048/news2048_text_document" \
    --tokenizer-model "$DATA/bpe2048/bpe2048.model" --lr 0.019 --seed 3 --replicas "$REPLICAS" \
    --end-step 1300 --nice 15 "$@" > "$OUT/$name.log" 2>&1
}

part controls --snapshots 500,700,850,950,1000 &
part interventions --snapshots 1000 --intervene-at 1000 --skip-controls &
wait
part controls_early --snapshots 250 &
part interventions_500 --snapshots 500 --intervene-at 500 --skip-controls &
wait
part controls_init --snapshots 5 &
part interventions_500_layer1 --snapshots 500 --intervene-at 500 --interventions wo1_lr0.1 --skip-controls &
wait
python tools/trigger_experiment.py report "$OUT"/controls "$OUT"/interventions "$OUT"/controls_early \
  "$OUT"/interventions_500 "$OUT"/controls_init "$OUT"/interventions_500_layer1 --keep "$KEEP"
