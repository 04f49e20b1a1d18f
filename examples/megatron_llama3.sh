#!/bin/bash
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (NVIDIA/Megatron-LM, d98e8a6), adapted to
# megapost and shrunk to a model that trains on 2 CPU cores. Its flags are Megatron's, unchanged;
# megapost accepts, maps or notes each one at start-up (docs/flags.md, "Coming from Megatron-LM").
# What differs from the original, and why:
#   - sizes: 2 layers x 64 (4 heads, 2 KV groups), seq 64, 4 x 16 samples, 1 rank (GPUS_PER_NODE=1);
#   - DTYPE=bf16 instead of fp8 (megapost has no fp8; its --fp8-* flags are refused in one line);
#   - the real-data branch on megapost's embedded corpus, SentencePiece tokenizer (not HF/tiktoken);
#   - --decoupled-lr/--decoupled-min-lr dropped (refused: megapost has one lr for all parameters);
#   - --normalization RMSNorm spelled out (Llama's norm; Megatron's default, LayerNorm, is refused here),
#     and --tensorboard-queue-size, --log-validation-ppl-to-tensorboard, --timing-log-level added;
#   - PRETRAIN_SCRIPT_PATH is the megapost module, and LAUNCHER=torchrun|deepspeed picks the launcher;
#   - no `export CUDA_DEVICE_MAX_CONNECTIONS=1`: Megatron sets it so its TP/SP comm kernels are queued
#     in issue order; megapost has no such overlap, and one hardware queue would serialise DeepSpeed's
#     gradient-reduction stream and the async save's copy stream behind the compute stream.
#
#   bash examples/megatron_llama3.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA]]]]
#   LAUNCHER=deepspeed bash examples/megatron_llama3.sh ...
# Megatron's habit --save X --load X: the first launch starts fresh, the next resumes.
set -e
REPO=$(cd "$(dirname "$0")/.." && pwd)
DATA_DIR=${MEGAPOST_DATA_DIR:-$REPO/data}

CHECKPOINT_PATH=${1:-"checkpoints/llama3_tiny"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_tiny"}
TOKENIZER_ARG=${3:-"$DATA_DIR/tokenizer.model"}
DATA_ARG=${4:-"$DATA_DIR/news_text_document"}
if [ ! -f "$DATA_ARG.idx" ] && [ "$DATA_ARG" = "$DATA_DIR/news_text_document" ]; then
    ${PYTHON:-python3} "$REPO/tools/prepare_default_data.py" --data-dir "$DATA_DIR"  # embedded corpus, once
fi
mkdir -p "$(dirname "$CHECKPOINT_PATH")"
mkdir -p "$(dirname "$TENSORBOARD_LOGS_PATH")"

GPUS_PER_NODE=${GPUS_PER_NODE:-1}
NUM_NODES=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
if [ -z "${MASTER_PORT:-}" ]; then  # none given: a free one (a busy 29500 would fail the launch)
    MASTER_PORT=$(${PYTHON:-python3} -m megapost.utils.ports)
    echo "MASTER_PORT not set: using free port $MASTER_PORT (set MASTER_PORT to choose one)"
fi
NODE_RANK=${NODE_RANK:-0}
LAUNCHER=${LAUNCHER:-torchrun}

TP_SIZE=1
CP_SIZE=1
MICRO_BATCH_SIZE=2
GLOBAL_BATCH_SIZE=4
NUM_LAYERS=2
DTYPE="bf16"
SEQ_LENGTH=64
MAX_POSITION_EMBEDDINGS=64
DATA_CACHE_PATH=${DATA_CACHE_PATH:-"${PWD}/benchmark_cache_llama3_tiny"}
mkdir -p "$DATA_CACHE_PATH"

if [ "$LAUNCHER" = "deepspeed" ]; then
    DISTRIBUTED_ARGS=(--num_nodes $NUM_NODES --num_gpus $GPUS_PER_NODE --master_addr $MASTER_ADDR
                      --master_port $MASTER_PORT --module)
else
    DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES --node_rank $NODE_RANK
                      --master_addr $MASTER_ADDR --master_port $MASTER_PORT -m)
fi
PRETRAIN_SCRIPT_PATH="megapost.pretrain"

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 192
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples 16
    --lr-decay-samples 16
    --lr-warmup-samples 4
    --lr 0.00015
    --min-lr 0.00001
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --${DTYPE}
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)

DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

DATA_ARGS_LIST=(
    --data-path $DATA_ARG
    --tokenizer-type SentencePieceTokenizer
    --tokenizer-model $TOKENIZER_ARG
    --data-cache-path ${DATA_CACHE_PATH}
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers 1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 1
    --eval-interval 2
    --save-interval 2
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --tensorboard-queue-size 5
    --log-validation-ppl-to-tensorboard
    --timing-log-level 0
)

$LAUNCHER ${DISTRIBUTED_ARGS[@]} \
    $PRETRAIN_SCRIPT_PATH \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS_LIST[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "${@:5}"
