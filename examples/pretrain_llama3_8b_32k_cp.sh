#!/usr/bin/env bash
# Llama-3.1-8B FP8 pretraining at 32k tokens per sequence with context parallelism: a template for 2 (or
# any even number of) 8-GPU nodes. Run the same command on every node, changing only NODE_RANK.
#
#   NNODES=2 NODE_RANK=0 MASTER=node0.cluster DATA_PATH=/data/long_text_document \
#   TOKENIZER=/models/Meta-Llama-3.1-8B bash examples/pretrain_llama3_8b_32k_cp.sh
#
# Layout, TP innermost (Megatron's order tp-cp-dp-pp): tensor parallel 4 (an NVLink island, with sequence
# parallelism) x context parallel 2 (each 32k sequence cut into 4 chunks of 8k, rank r holding chunks r and
# 3-r; K/V travel in a p2p ring overlapped with attention) x pipeline parallel 2 (interleaved, 2 virtual
# stages of 8 layers per rank) = 16 GPUs per model replica; data parallel = NNODES / 2. The ZeRO optimizer
# shards over DP x CP. Each rank holds 16k tokens of a sequence, 4k of them per TP rank between the TP
# regions; selective recomputation keeps the attention scores out of the saved activations.
#
# Install on the GPU machine (its own CUDA build of torch first): pip install -e ".[data,tensorboard]"
# (the tokenizer and TensorBoard packages these flags use; plain `pip install -e .` installs neither).
#
# Environment (defaults in brackets): NNODES [2], NODE_RANK [0], MASTER [localhost], NPROC_PER_NODE [8],
# DATA_PATH [data/long_text_document] (a preprocessed prefix, docs/data.md), TOKENIZER
# [models/Meta-Llama-3.1-8B], RUN_DIR [runs/llama3_8b_32k_cp], TRAIN_ITERS [20000], GLOBAL_BATCH_SIZE [128]
# (x 32768 tokens = 4M). Rerunning resumes from RUN_DIR's latest checkpoint; --load reshards, so a run at
# another CP, TP, PP or DP size picks up the same checkpoint (docs/checkpoints.md, docs/parallelism.md).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
MASTER="${MASTER:-localhost}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
DATA_PATH="${DATA_PATH:-data/long_text_document}"
TOKENIZER="${TOKENIZER:-models/Meta-Llama-3.1-8B}"
RUN_DIR="${RUN_DIR:-runs/llama3_8b_32k_cp}"
TRAIN_ITERS="${TRAIN_ITERS:-20000}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-128}"
mkdir -p "$RUN_DIR"

# The Llama block, said as Megatron-LM's Llama scripts say it (Megatron's defaults describe a GPT-3 block, which
# megafp8 refuses): RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)

flags=(
  # Llama-3.1-8B: Llama-3-8B's shapes with Llama-3.1's RoPE frequency scaling (factor 8 from 8192 positions)
  "${LLAMA_BLOCK[@]}"
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8
  --seq-length 32768 --max-position-embeddings 32768 --rotary-base 500000 --norm-epsilon 1e-5
  --use-rope-scaling --rope-scaling-factor 8
  --untie-embeddings-and-output-weights --init-method-std 0.02 --make-vocab-size-divisible-by 128
  # 4D layout: TP4 x CP2 x PP2 per replica
  --tensor-model-parallel-size 4 --sequence-parallel
  --context-parallel-size 2 --cp-comm-type p2p
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 8
  --recompute-granularity selective
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --distributed-timeout-minutes 30
  # precision: bf16, FP8 GEMMs with delayed scaling (attention itself in high precision), FP8 param all-gather
  --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --fp8-param-gather
  # optimizer and schedule
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
  # data
  --data-path "$DATA_PATH" --split 990,9,1 --seed 1234
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --eval-interval 500 --eval-iters 5
  # checkpoints and logs
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 500 --keep-last 3
  --log-interval 10 --log-dir "$RUN_DIR/logs" --tensorboard-dir "$RUN_DIR/tensorboard"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1  # kernels in issue order: communication overlaps as scheduled
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id llama3_8b_32k_cp \
  -m megafp8.pretrain "${flags[@]}"
