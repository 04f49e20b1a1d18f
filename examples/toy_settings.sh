# The collapse toy's settings (sourced by collapse_toy.sh and placement_study.sh; any can be overridden
# from the environment): a 12-layer, d=64 Llama, seq 128, batch 8, 150 steps, peak lr 1e-2 (cosine to
# 1e-3), no warmup, collapse_metrics every K steps.
LAYERS=${LAYERS:-12}
HIDDEN=${HIDDEN:-64}
SEQ=${SEQ:-128}
BATCH=${BATCH:-8}
ITERS=${ITERS:-150}
LR=${LR:-1e-2}
MIN_LR=${MIN_LR:-1e-3}
K=${K:-5}  # --collapse-interval
SEED=${SEED:-1234}
