#!/usr/bin/env bash
# The paper's shape on one GPU (issue 40 item 4): Post-Norm 512 x 48 (d_ff 1536, 4 heads), the default
# corpus's 32,000-token tokenizer, warmup 2000 (the paper's), then a CONSTANT lr, 8,192 tokens per step
# (32 x 256), 2,600 steps, bf16; lrs 4e-4, 6e-4, 8e-4 and 1.2e-3 as four concurrent processes on the one
# device (tools/stability_sweep.py --jobs 4 --engine subprocess: every slot gets CUDA_VISIBLE_DEVICES=0).
# At the end (and when stopped early: a run still going is judged on the steps it has) one JSON,
# $OUT/events.json (megapost-law events): each run's outcome -- failed to start, delayed collapse,
# survived (megapost/study/events.py) -- with its step.
#
# Budget (estimate, not measured: no GPU here): ~190M parameters x 6 x 8,192 tokens = 9.3 TFLOP per step,
# x 2,600 steps x 4 runs = 9.7e16 FLOP; at 250-300 TFLOP/s bf16 on an H200 that is 5.4-6.5 min, plus
# ~1 min of start-up. Run it under a timeout that leaves time for events.json:
#   timeout 470 bash examples/paper_shape_gpu.sh; python -m megapost.study events runs/paper_shape/sweep
#   DRY_RUN=1 bash examples/paper_shape_gpu.sh     # CPU, tiny (64 x 2, 40 steps, 2 lrs): the command works
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/paper_shape}
DATA=${DATA:-$OUT/data}
if [ -n "${DRY_RUN:-}" ]; then
  SHAPE=(--hidden 64 --depths 2 --seq-length 32 --batch 4 --warmups 10 --iters 40 --lrs 4e-4,1.2e-3
         --jobs 2 --interval 5)
  EXTRA=()
else
  SHAPE=(--hidden 512 --depths 48 --seq-length 256 --batch 32 --warmups 2000 --iters 2600
         --lrs 4e-4,6e-4,8e-4,1.2e-3 --jobs 4 --interval 10)
  EXTRA=(-- --bf16)
fi
python tools/prepare_default_data.py --data-dir "$DATA" >/dev/null
python tools/stability_sweep.py --out "$OUT/sweep" --data-path "$DATA/news_text_document" \
  --tokenizer-model "$DATA/tokenizer.model" --variants post --decay-style constant --heads 4 --seeds 1 \
  --engine subprocess --nice 0 "${SHAPE[@]}" "${EXTRA[@]}" > "$OUT/sweep.log" 2>&1 || echo "sweep exit $?"
python -m megapost.study events "$OUT/sweep" > "$OUT/.events.json.tmp" && mv "$OUT/.events.json.tmp" "$OUT/events.json"
cat "$OUT/events.json"
