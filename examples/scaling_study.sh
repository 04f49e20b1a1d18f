#!/usr/bin/env bash
# The whole default study of docs/collapse_study.md "Scaling the study", one command, resumable (every run
# is a tools/stability_sweep.py cell: a finished run is read back, never re-run), on the embedded news
# corpus tokenized with a 2,048-token BPE trained on it. Parts (PARTS, default all four, in this order):
#   outcomes  the delayed-collapse settings (4 layers, d 64, seq 64, batch 8, lr 3e-2, warmup 200, 400
#             steps) over SEEDS (default 1-16), Post-Norm and its Pre-Norm twin: P(collapsed / delayed /
#             plateau / trained) with Wilson 95 % intervals, early-warning calibration -> $RUNS/outcomes
#   boundary  tools/collapse_boundary.py's default grid (widths 64,128,256 x depths 4,8,16, 3 seeds,
#             ends + widening + 3 bisection steps; warmup 20, 150 steps, seq 32) -> $RUNS/boundary
#             (boundary.json -> megapost-law boundary $RUNS/boundary/boundary.json -> the planner's law)
#   autopsy   --collapse-autopsy 40 on the first delayed seed that collapses and the first that ends on the
#             plateau (else trains) in outcomes' results + the aligned figure -> $RUNS/autopsy{,.png}
#   guard     both remedies (lr*0.5, rewarm) on the immediate setting (12 layers, lr 1e-2, no warmup, 150
#             steps; on the alarm; GUARD_SEEDS, default 1-4; + unguarded and Pre-Norm) and on the delayed
#             one (on the early warning, snapshots every 50 steps; GUARD_DELAYED_SEEDS, default SEEDS);
#             P(rescued) per remedy (tools/guard_rescue.py) -> $RUNS/guard_{immediate,delayed}.md
# Each part prints its wall time; the last line is the whole study's. JOBS processes (default: the cores),
# one thread each.
#
#   bash examples/scaling_study.sh                          # all four parts
#   PARTS=boundary bash examples/scaling_study.sh           # one part
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/scaling_study}
PARTS=${PARTS:-outcomes,boundary,autopsy,guard}
SEEDS=${SEEDS:-1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}
GUARD_SEEDS=${GUARD_SEEDS:-1,2,3,4}
GUARD_DELAYED_SEEDS=${GUARD_DELAYED_SEEDS:-$SEEDS}
JOBS=${JOBS:-$(python -c "import os; print(len(os.sched_getaffinity(0)))")}
DATA_DIR=${DATA_DIR:-data/bpe2k}
CORPUS=${CORPUS:-}  # with TOKENIZER: another corpus prefix and its tokenizer (then nothing is prepared)
DATA=(--data-path "${CORPUS:-$DATA_DIR/news2k_text_document}" --tokenizer-model "${TOKENIZER:-$DATA_DIR/bpe2k.model}")
# SIZE_FLAGS: sweep flags appended to every part's runs (e.g. a smaller --hidden/--iters for a smoke run)
read -r -a size <<< "${SIZE_FLAGS:-}"
DELAYED=(--depths 4 --lrs 3e-2 --warmups 200 --iters 400 --interval 4 "${size[@]}")
IMMEDIATE=(--depths 12 --lrs 1e-2 --warmups 0 --iters 150 --interval 4 "${size[@]}")
read -r -a BOUNDARY <<< "${BOUNDARY_FLAGS:-}"  # e.g. --widths 64 --depths 4,8 (tools/collapse_boundary.py)
GUARD=(--collapse-guard --collapse-guard-retries 3)

study_start=$(date +%s)
part() {  # part NAME: run it if PARTS names it, with its wall time
  [[ ",$PARTS," == *",$1,"* ]] || return 0
  local t0
  t0=$(date +%s)
  "part_$1"
  echo "[study] part $1: $(( $(date +%s) - t0 )) s"
}

part_outcomes() {
  python tools/stability_sweep.py --out "$RUNS/outcomes" "${DATA[@]}" "${DELAYED[@]}" --variants post,pre \
    --seeds "$SEEDS" --jobs "$JOBS"
}

part_boundary() {
  python tools/collapse_boundary.py --out "$RUNS/boundary" "${DATA[@]}" --jobs "$JOBS" "${BOUNDARY[@]}"
}

seeds_that() {  # seeds_that OUTCOME...: the delayed Post-Norm seeds of the outcomes part with that outcome
  python - "$RUNS/outcomes/results.csv" "$@" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["variant"] == "post"]
for want in sys.argv[2:]:
    seeds = [r["seed"] for r in rows if r["outcome"] == want]
    if seeds:
        print(",".join(seeds))
        break
else:
    print("")
PY
}

part_autopsy() {
  local bad good name
  bad=$(seeds_that collapsed | cut -d, -f1)
  good=$(seeds_that plateau trained | cut -d, -f1)
  if [ -z "$bad" ] || [ -z "$good" ]; then
    echo "[study] autopsy skipped: outcomes has no collapsing and non-collapsing seed pair"; return 0
  fi
  if [ -n "$(seeds_that plateau)" ]; then name=plateau; else name=trained; fi
  python tools/stability_sweep.py --out "$RUNS/autopsy" "${DATA[@]}" "${DELAYED[@]}" --variants post \
    --seeds "$good,$bad" --jobs "$JOBS" -- --collapse-early-warning --collapse-autopsy 40 \
    --collapse-autopsy-after 160 --collapse-autopsy-hessian-every 8 --collapse-autopsy-power-iters 3
  python tools/plot_autopsy.py --out "$RUNS/autopsy" --align event \
    --run "collapsed_s$bad=$RUNS/autopsy/cells/post_L4_lr0.03_w200_s$bad/tensorboard" \
    --run "${name}_s$good=$RUNS/autopsy/cells/post_L4_lr0.03_w200_s$good/tensorboard"
}

part_guard() {
  local tag guarded_immediate=() guarded_delayed=()
  python tools/stability_sweep.py --out "$RUNS/guard_none" "${DATA[@]}" "${IMMEDIATE[@]}" --variants post,pre \
    --seeds "$GUARD_SEEDS" --jobs "$JOBS"
  for remedy in 'lr*0.5' rewarm; do
    tag=${remedy//[*.]/}
    python tools/stability_sweep.py --out "$RUNS/guard_$tag" "${DATA[@]}" "${IMMEDIATE[@]}" --variants post \
      --seeds "$GUARD_SEEDS" --jobs "$JOBS" -- "${GUARD[@]}" --collapse-guard-remedy "$remedy"
    python tools/stability_sweep.py --out "$RUNS/guard_delayed_$tag" "${DATA[@]}" "${DELAYED[@]}" \
      --variants post --seeds "$GUARD_DELAYED_SEEDS" --jobs "$JOBS" -- "${GUARD[@]}" --collapse-early-warning \
      --collapse-guard-on early --collapse-guard-interval 50 --collapse-guard-remedy "$remedy"
    guarded_immediate+=(--guarded "$remedy=$RUNS/guard_$tag")
    guarded_delayed+=(--guarded "$remedy=$RUNS/guard_delayed_$tag")
  done
  python tools/guard_rescue.py --unguarded "$RUNS/guard_none" "${guarded_immediate[@]}" --out "$RUNS/guard_immediate.md"
  python tools/guard_rescue.py --unguarded "$RUNS/outcomes" "${guarded_delayed[@]}" --out "$RUNS/guard_delayed.md"
}

if [ -z "$CORPUS" ]; then
  python tools/prepare_default_data.py >/dev/null
  if [ ! -f "$DATA_DIR/news2k_text_document.idx" ]; then
    python tools/train_tokenizer.py --input 'data/news/*.json.gz' --vocab-size 2048 --output-prefix "$DATA_DIR/bpe2k"
    python tools/preprocess_data.py --input 'data/news/*.json.gz' --output-prefix "$DATA_DIR/news2k" \
      --tokenizer-model "$DATA_DIR/bpe2k.model" --append-eod --workers 1
  fi
fi
for name in outcomes boundary autopsy guard; do part "$name"; done
echo "[study] the whole study ($PARTS): $(( $(date +%s) - study_start )) s with $JOBS jobs"
