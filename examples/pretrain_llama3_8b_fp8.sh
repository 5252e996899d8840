#!/usr/bin/env bash
# Llama-3-8B FP8 pretraining on several 8-GPU nodes: a template. Run the same command on every node,
# changing only NODE_RANK; the c10d rendezvous on MASTER:29500 gathers them (NCCL between GPUs).
#
#   NNODES=4 NODE_RANK=0 MASTER=node0.cluster DATA_PATH=/data/fineweb_text_document \
#   TOKENIZER=/models/Meta-Llama-3-8B bash examples/pretrain_llama3_8b_fp8.sh
#
# Layout per node of 8 GPUs: tensor parallel 4 (inside an NVLink island, with sequence parallelism) x
# pipeline parallel 2 (interleaved, 2 virtual stages of 8 layers each per rank); data parallel = NNODES,
# sharded with the ZeRO distributed optimizer, parameters all-gathered in FP8, gradient reduce-scatter and
# parameter gather overlapped with compute. GEMMs run in FP8 (E4M3 forward, E5M2 gradients: "hybrid")
# with delayed scaling; everything else in bf16.
#
# Install on the GPU machine (its own CUDA build of torch first): pip install -e ".[data,tensorboard]"
# (the tokenizer and TensorBoard packages these flags use; plain `pip install -e .` installs neither).
#
# Environment (defaults in brackets): NNODES [4], NODE_RANK [0], MASTER [localhost], NPROC_PER_NODE [8],
# DATA_PATH [data/llama3_text_document] (a preprocessed prefix, docs/data.md), TOKENIZER
# [models/Meta-Llama-3-8B] (a local HF tokenizer directory or tokenizer.json), RUN_DIR [runs/llama3_8b_fp8]
# (checkpoints, metrics, TensorBoard), TRAIN_ITERS [100000], GLOBAL_BATCH_SIZE [512] (x 8192 tokens = 4M).
# Rerunning the same command resumes from the latest checkpoint in RUN_DIR; --load also reshards, so a
# different NNODES (data parallel size) or TP/PP layout picks up the same checkpoint (docs/checkpoints.md).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES="${NNODES:-4}"
NODE_RANK="${NODE_RANK:-0}"
MASTER="${MASTER:-localhost}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
DATA_PATH="${DATA_PATH:-data/llama3_text_document}"
TOKENIZER="${TOKENIZER:-models/Meta-Llama-3-8B}"
RUN_DIR="${RUN_DIR:-runs/llama3_8b_fp8}"
TRAIN_ITERS="${TRAIN_ITERS:-100000}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}"
mkdir -p "$RUN_DIR"

# The Llama block, said as Megatron-LM's Llama scripts say it (Megatron's defaults describe a GPT-3 block, which
# megafp8 refuses): RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)

flags=(
  # Llama-3-8B: 32 layers, hidden 4096, SwiGLU FFN 14336, 32 heads in 8 KV groups (GQA), RoPE base 500000,
  # untied embedding and output layer; the vocabulary (128256) comes from the tokenizer.
  "${LLAMA_BLOCK[@]}"
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8
  --seq-length 8192 --max-position-embeddings 8192 --rotary-base 500000 --norm-epsilon 1e-5
  --untie-embeddings-and-output-weights --init-method-std 0.02 --make-vocab-size-divisible-by 128
  # 3D layout
  --tensor-model-parallel-size 4 --sequence-parallel
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 8
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --distributed-timeout-minutes 30
  # precision: bf16, FP8 GEMMs with delayed scaling, FP8 parameter all-gather
  --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --fp8-param-gather
  # optimizer and schedule (Llama 3's: peak 3e-4, cosine to 10%, 2000 warm-up steps)
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
  # data
  --data-path "$DATA_PATH" --split 990,9,1 --seed 1234
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --eval-interval 1000 --eval-iters 10
  # checkpoints (resumes from the latest one in $RUN_DIR/checkpoints when there is one) and logs
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000 --keep-last 3
  --log-interval 10 --log-dir "$RUN_DIR/logs" --tensorboard-dir "$RUN_DIR/tensorboard"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1  # kernels in issue order: communication overlaps as scheduled
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id llama3_8b_fp8 \
  -m megafp8.pretrain "${flags[@]}"
