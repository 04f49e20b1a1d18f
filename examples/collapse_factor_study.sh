#!/usr/bin/env bash
# What moves lr* besides d and L (issue 25 items 1 and 2): one tools/collapse_boundary.py bracket per
# setting, each changing ONE factor from the base shape (d 64 x 4 layers, 4 heads, warmup 20, 150 steps,
# seq 32 x batch 8 = 256 tokens/step, the 2,048-token BPE, --init-variance paper), then warmup x depth,
# then widths above 256 and the paper's 512 x 48 shape. Brackets start at the shipped law's lr*(d, L) x
# [1/2, 2] and widen by 3x; seeds 1-3 adaptive (a probe stops once its vote is decided); persistent
# workers. Every sweep is its own folder under $OUT with a results.csv rewritten after every run (one row
# per run: docs/collapse_study.md "results.csv columns"); everything is resumable (a rerun reads finished
# runs back), so stopping and re-running this script loses at most the runs in flight. PARTS picks parts
# (default: all, in priority order): warmup depth width paper w2000 factors deep (tokens and seq: those two
# factors alone). WIDE, TOKENS, SEQS: the widths, batches and seq:batch pairs of those parts. KEEP (default
# study/results): where each sweep's results.csv is copied after every sweep, the folder the shipped law
# is fitted from (megapost-law boundary study/results), so the study's data travels with the
# repository and not only with $OUT.
#
#   OUT=/work/study bash examples/collapse_factor_study.sh
#   PARTS=warmup,depth OUT=/work/study bash examples/collapse_factor_study.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/factor_study}
PARTS=${PARTS:-warmup,depth,width,paper,w2000,factors,deep}
JOBS=${JOBS:-$(python -c "import os; print(len(os.sched_getaffinity(0)))")}
WIDE=${WIDE:-512 768}
TOKENS=${TOKENS:-4 32 128}       # batches of the tokens part (x seq 32 = 128, 1024, 4096 tokens/step)
SEQS=${SEQS:-16:16 64:4 128:2 256:1}  # seq:batch of the seq part (256 tokens/step each)
KEEP=${KEEP:-study/results}
DATA=${DATA:-$OUT/data}  # the corpus, tokenized with 512/2048/8192-token BPEs and the default 32k tokenizer
read -r -a EXTRA <<< "${STUDY_FLAGS:-}"  # e.g. --flush-denormal, or --engine subprocess
LAW=study/results/grid_w20/boundary.json
COMMON=(--lr-from-law "$LAW" --law-factor 2 --lr-widen 3 --bisect-steps 2 --seeds 1,2,3 --jobs "$JOBS"
        --nice 10 --interval 4 --widths 64 --depths 4 --warmup 20 --iters 150 --seq-length 32 --batch 8
        --presets paper-180m)

prepare() {
  python tools/prepare_default_data.py --data-dir "$DATA" >/dev/null
  for v in 512 2048 8192; do
    [ -f "$DATA/bpe$v/news${v}_text_document.idx" ] && continue
    python tools/train_tokenizer.py --input "$DATA/news/*.json.gz" --vocab-size "$v" --output-prefix "$DATA/bpe$v/bpe$v"
    python tools/preprocess_data.py --input "$DATA/news/*.json.gz" --output-prefix "$DATA/bpe$v/news$v" \
      --tokenizer-model "$DATA/bpe$v/bpe$v.model" --append-eod --workers 1
  done
}

vocab() {  # vocab N: the --data-path/--tokenizer-model flags of that vocabulary
  if [ "$1" = 32000 ]; then echo "--data-path $DATA/news_text_document --tokenizer-model $DATA/tokenizer.model"
  else echo "--data-path $DATA/bpe$1/news$1_text_document --tokenizer-model $DATA/bpe$1/bpe$1.model"; fi
}

sweep() {  # sweep NAME [collapse_boundary flags...]: one bracket folder, its status line in $OUT/STATUS.md
  local name=$1 t0 rc=0 lock
  shift
  t0=$(date +%s)
  mkdir -p "$OUT/$name"
  exec {lock}>"$OUT/$name/.lock"
  if ! flock -n "$lock"; then  # another driver is on this sweep: two on one folder would race on its cells
    echo "$(date -u +%H:%M:%S) skipped  $name (another driver holds it)" >> "$OUT/STATUS.md"; return 0
  fi
  echo "$(date -u +%H:%M:%S) started  $name: $*" >> "$OUT/STATUS.md"
  # shellcheck disable=SC2046
  python tools/collapse_boundary.py --out "$OUT/$name" $(vocab 2048) "${COMMON[@]}" "$@" "${EXTRA[@]}" \
    > "$OUT/$name.log" 2>&1 || rc=$?
  flock -u "$lock"
  if [ -n "$KEEP" ] && [ -f "$OUT/$name/results.csv" ]; then  # temp name, then rename
    mkdir -p "$KEEP/$name" && cp "$OUT/$name/results.csv" "$KEEP/$name/.results.csv.tmp" \
      && mv "$KEEP/$name/.results.csv.tmp" "$KEEP/$name/results.csv"
  fi
  echo "$(date -u +%H:%M:%S) finished $name (exit $rc, $(( $(date +%s) - t0 )) s, $(tail -n +2 "$OUT/$name/results.csv" 2>/dev/null | wc -l) runs)" >> "$OUT/STATUS.md"
}

part_warmup() {  # warmup at 4 layers; 130 steps after the warmup (150 at warmup <= 20)
  for w in 0 20 100 500; do sweep "warmup/w$w" --warmup "$w" --iters $(( w + 130 > 150 ? w + 130 : 150 )); done
}
part_depth() {  # warmup x depth
  for L in 8 16; do for w in 0 20 100 500; do
    sweep "warmup_depth/L${L}_w$w" --depths "$L" --warmup "$w" --iters $(( w + 130 > 150 ? w + 130 : 150 ))
  done; done
}
part_width() {  # widths above 256 at 4 layers, 4 heads as the 64-256 grid (one seed, 1 bisection: costly runs)
  for d in $WIDE; do sweep "width/d$d" --widths "$d" --seeds 1 --bisect-steps 1; done
}
part_paper() {  # the paper's shape 512 x 48 (8 heads) at seq 16 x batch 4, 40 steps, warmup 10, one seed
  sweep "paper_512x48" --widths 512 --depths 48 --heads 8 --seq-length 16 --batch 4 --iters 40 --warmup 10 \
    --seeds 1 --bisect-steps 1 --interval 2
}
part_w2000() { sweep "warmup/w2000" --warmup 2000 --iters 2130 --seeds 1,2 --interval 20; }
part_deep() {  # warmup x depth at the paper's 48 layers (width 64): the depth x warmup term measured, not extrapolated
  for w in 0 20 100 500; do
    sweep "warmup_depth/L48_w$w" --depths 48 --warmup "$w" --iters $(( w + 130 > 150 ? w + 130 : 150 ))
  done
}
part_tokens() { for b in $TOKENS; do sweep "tokens/b$b" --batch "$b"; done; }  # tokens per step
part_seq() {  # sequence length at 256 tokens/step
  for sb in $SEQS; do sweep "seq/s${sb%:*}" --seq-length "${sb%:*}" --batch "${sb#*:}"; done
}
part_factors() {  # one factor at a time from the base shape
  part_tokens
  for it in 300 600; do sweep "length/i$it" --iters "$it"; done                    # training length
  part_seq
  for v in 512 8192 32000; do
    # shellcheck disable=SC2046
    sweep "vocab/v$v" $(vocab "$v")
  done
  for h in 1 16; do sweep "heads/h$h" --heads "$h"; done
  sweep "init/std" --init-variance std
}

mkdir -p "$OUT"
prepare
for part in warmup depth width paper w2000 factors deep tokens seq; do
  [[ ",$PARTS," == *",$part,"* ]] && "part_$part"
done
echo "$(date -u +%H:%M:%S) study done ($PARTS)" >> "$OUT/STATUS.md"
