#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped mixture-of-experts pretraining in FP8: a template for 2 (or any even number of) 8-GPU nodes.
# Run the same command on every node, changing only NODE_RANK.
#
#   NNODES=2 NODE_RANK=0 MASTER=node0.cluster DATA_PATH=/data/text_document \
#   TOKENIZER=/models/Qwen3-30B-A3B bash examples/pretrain_moe_qwen3_30b_a3b.sh
#
# The model (Qwen3-30B-A3B's config.json): 48 layers, hidden 2048, 32 query heads and 4 KV heads of 128 channels
# with per-head QK RMSNorm, every layer a MoE of 128 experts (SwiGLU, 768 wide), 8 per token with the softmax over
# the chosen 8 (norm_topk_prob), its load-balancing loss at 0.001; ~30B parameters, ~3B active per token.
# Layout (docs/parallelism.md, "Mixture of experts"): pipeline parallel 2 x tensor parallel 2 (with sequence
# parallelism) x data parallel NNODES x 2 for attention and the dense weights; the experts fold over the same 8 ranks
# of a stage as expert parallel 8 (16 experts per GPU, tokens dispatched by all-to-all in FP8 bytes). FP8: DeepSeek-
# V3's blockwise recipe with power-of-two scales (the recommended MoE recipe: the FP8 dispatch is lossless under it).
#
# Install on the GPU machine (its own CUDA build of torch first): pip install -e ".[data,tensorboard]"
#
# Environment (defaults in brackets): NNODES [2], NODE_RANK [0], MASTER [localhost], NPROC_PER_NODE [8],
# DATA_PATH [data/text_document] (a preprocessed prefix, docs/data.md), TOKENIZER [models/Qwen3-30B-A3B],
# RUN_DIR [runs/qwen3_30b_a3b], TRAIN_ITERS [50000], GLOBAL_BATCH_SIZE [256] (x 4096 tokens = 1M). Rerunning
# resumes from RUN_DIR's latest checkpoint; --load reshards (experts too, across EP sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
MASTER="${MASTER:-localhost}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
DATA_PATH="${DATA_PATH:-data/text_document}"
TOKENIZER="${TOKENIZER:-models/Qwen3-30B-A3B}"
RUN_DIR="${RUN_DIR:-runs/qwen3_30b_a3b}"
TRAIN_ITERS="${TRAIN_ITERS:-50000}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-256}"
mkdir -p "$RUN_DIR"

# The Llama block, said as Megatron-LM's scripts say it: RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)

flags=(
  "${LLAMA_BLOCK[@]}"
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 --kv-channels 128
  --group-query-attention --num-query-groups 4 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 40960 --rotary-base 1000000 --norm-epsilon 1e-6
  --untie-embeddings-and-output-weights --init-method-std 0.02 --make-vocab-size-divisible-by 128
  # mixture of experts: every layer, 128 experts of 768, top 8, softmax over the chosen 8, aux loss 1e-3
  --num-experts 128 --moe-layer-freq 1 --moe-ffn-hidden-size 768 --moe-router-topk 8
  --moe-router-score-function softmax --moe-router-dtype fp32 --moe-router-load-balancing-type aux_loss
  --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
  # layout: PP2 x TP2 (SP) x DP for the dense part; the experts over EP 8 of each stage's 8 ranks
  --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce
  --distributed-timeout-minutes 30
  # precision: bf16, FP8 GEMMs with DeepSeek-V3's blockwise scaling (1x128 / 128x128, power-of-two scales)
  --bf16 --fp8-format e4m3 --fp8-recipe blockwise --fp8-power-of-2-scale
  # optimizer and schedule
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
  # data
  --data-path "$DATA_PATH" --split 990,9,1 --seed 1234
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --eval-interval 1000 --eval-iters 5
  # checkpoints and logs
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000 --keep-last 3
  --log-interval 10 --log-dir "$RUN_DIR/logs" --tensorboard-dir "$RUN_DIR/tensorboard"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1  # kernels in issue order: communication overlaps as scheduled
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id qwen3_30b_a3b \
  -m megafp8.pretrain "${flags[@]}"
