#!/usr/bin/env bash
# The delayed-collapse law's experiments (issue 40 item 3): long constant-lr Post-Norm runs after a long
# warmup, so the event measured is the paper's (learn, then collapse) and the lr at the event is the
# peak lr. One tools/stability_sweep.py folder per experiment; resumable (a rerun skips finished runs);
# results.csv and each run's per-step series copied into study/results/<exp>/ after every sweep
# (megapost-law collect; then `make law` refits; docs/study_results.md).
#   E1 horizon: 64 x 4, 256 tokens/step, warmup 500, constant lr, 2,000 steps at peak, 4 lrs x 4 seeds
#   E2 batch:   64 x 4, warmup 500, 1,000 steps at peak, 256 / 1,024 / 4,096 tokens/step, 3 lrs x 2 seeds
#   E3 depth:   128 x {8, 16, 32}, warmup 1,000, 700 steps at peak, 3 lrs x 2 seeds
#   E2hi:       E2 at 1,024 tokens/step with lrs 0.035, 0.05 (part e2's lrs all survived there)
#   E2top:      E2 at 1,024 tokens/step with lrs 0.07, 0.1, 0.14; E3l32: x32 at 2 lrs x 1 seed
#   E2sat:      E2 at 4,096 tokens/step with lrs 0.07, 0.14, 0.28 (does the batch term saturate?)
# What ran on 2 shared cores on 2026-12-04 (docs/study_results.md): E1 whole; E3 x8 whole, x16 in part,
# x32 cut; E2 at 1,024 tokens/step whole, E2hi; E2 at 4,096 cut (its lrs cannot reach an event there).
#
#   OUT=/work/study_runs DATA=/work/study_data PARTS=e1,e3,e2 bash examples/law_experiments.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/law_experiments}
DATA=${DATA:-$OUT/data}
PARTS=${PARTS:-e1,e3,e2}
JOBS=${JOBS:-2}
KEEP=${KEEP:-study/results}
read -r -a EXTRA <<< "${STUDY_FLAGS:-}"

prepare() {
  python tools/prepare_default_data.py --data-dir "$DATA" >/dev/null
  [ -f "$DATA/bpe2048/news2048_text_document.idx" ] && return 0
  python tools/train_tokenizer.py --input "$DATA/news/*.json.gz" --vocab-size 2048 --output-prefix "$DATA/bpe2048/bpe2048"
  python tools/preprocess_data.py --input "$DATA/news/*.json.gz" --output-prefix "$DATA/bpe2048/news2048" \
    --tokenizer-model "$DATA/bpe2048/bpe2048.model" --append-eod --workers 1
}

sweep() {  # sweep NAME [stability_sweep flags...]
  local name=$1 rc=0
  shift
  mkdir -p "$OUT/$name"
  echo "$(date -u +%H:%M:%S) started  $name: $*" >> "$OUT/STATUS.md"
  python tools/stability_sweep.py --out "$OUT/$name" --data-path "$DATA/bpe2048/news2048_text_document" \
    --tokenizer-model "$DATA/bpe2048/bpe2048.model" --variants post --decay-style constant --jobs "$JOBS" \
    --nice 15 --flush-denormal --interval 5 --split 969,30,1 "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1 || rc=$?
  if [ -n "$KEEP" ] && [ -f "$OUT/$name/results.csv" ]; then  # results.csv + series/<cell>.csv
    python -m megapost.study collect "$OUT/$name" "$name" --results "$KEEP" || rc=$?
  fi
  echo "$(date -u +%H:%M:%S) finished $name (exit $rc)" >> "$OUT/STATUS.md"
}

part_e1() {
  sweep e1_horizon --hidden 64 --depths 4 --seq-length 32 --batch 8 --warmups 500 --iters 2500 \
    --lrs 0.01,0.014,0.019,0.025 --seeds 1,2,3,4
}
part_e3() {  # deepest last: 128 x 32 is the costliest cell
  sweep e3_depth/L8 --hidden 128 --depths 8 --seq-length 32 --batch 8 --warmups 1000 --iters 1700 \
    --lrs 0.004,0.007,0.012 --seeds 1,2
  sweep e3_depth/L16 --hidden 128 --depths 16 --seq-length 32 --batch 8 --warmups 1000 --iters 1700 \
    --lrs 0.0025,0.004,0.007 --seeds 1,2
  sweep e3_depth/L32 --hidden 128 --depths 32 --seq-length 32 --batch 8 --warmups 1000 --iters 1700 \
    --lrs 0.0015,0.0025,0.004 --seeds 1,2
}
part_e2hi() {  # added after E2 at 1,024 tokens/step survived every lr of part_e2: lrs that reach its events
  sweep e2_batch/t1024_hi --hidden 64 --depths 4 --seq-length 32 --batch 32 --warmups 500 --iters 1500 \
    --lrs 0.035,0.05 --seeds 1,2
}
part_e2top() {  # added after E2hi (0.035, 0.05) survived too: lrs that reach 1,024 tokens/step's events
  sweep e2_batch/t1024_top --hidden 64 --depths 4 --seq-length 32 --batch 32 --warmups 500 --iters 1500 \
    --lrs 0.07,0.1,0.14 --seeds 1,2
}
part_e2sat() {  # after E2top: does the batch's protection saturate past 1,024 tokens/step? (4,096, 1 lr per x2)
  sweep e2_batch/t4096_sat --hidden 64 --depths 4 --seq-length 32 --batch 128 --warmups 500 --iters 1500 \
    --lrs 0.07,0.14,0.28 --seeds 1,2
}
part_e3l32() {  # E3 x32 cut to 2 lrs x 1 seed (~30 min a run on 2 shared cores)
  sweep e3_depth/L32 --hidden 128 --depths 32 --seq-length 32 --batch 8 --warmups 1000 --iters 1700 \
    --lrs 0.0025,0.004 --seeds 1
}
part_e2() {
  for b in 8 32 128; do
    sweep "e2_batch/t$((32 * b))" --hidden 64 --depths 4 --seq-length 32 --batch "$b" --warmups 500 \
      --iters 1500 --lrs 0.014,0.019,0.025 --seeds 1,2
  done
}

prepare
mkdir -p "$OUT"
IFS=, read -r -a parts <<< "$PARTS"
for p in "${parts[@]}"; do "part_$p"; done
