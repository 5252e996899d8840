#!/usr/bin/env bash
# DeepSeek-V3's mixture-of-experts recipe in FP8 at a 16B-A3B-class shape: a template for 2 (or any number of) 8-GPU
# nodes. Run the same command on every node, changing only NODE_RANK.
#
#   NNODES=2 NODE_RANK=0 MASTER=node0.cluster DATA_PATH=/data/text_document \
#   TOKENIZER=/models/tokenizer bash examples/pretrain_moe_deepseek_v3_recipe.sh
#
# The recipe (DeepSeek-V3's technical report, Megatron-Core's flags): the first layer dense, every other layer a MoE
# of 64 routed SwiGLU experts (1408 wide) of which each token takes 6, plus 2 shared experts (2816 wide) every
# token goes through; the router's sigmoid scores choose with DeepSeek-V3's aux-loss-free expert bias (moved by 1e-3
# per step towards the mean load), the chosen 6 renormalised and scaled by 2.5, and a small per-sequence balancing
# loss (1e-4). FP8: the 1x128 / 128x128 blockwise recipe with power-of-two scales (the FP8 dispatch is lossless under
# it). Not DeepSeek-V3's: attention is grouped-query attention (MLA is not built) and there is no multi-token
# prediction; 27 layers, hidden 2048, ~16B parameters, ~3B active per token.
# Layout (docs/parallelism.md, "Mixture of experts"): tensor parallel 2 (with sequence parallelism) x data parallel
# NNODES x 4 for attention and the dense weights; the experts fold over the same ranks as expert parallel 8 (8 experts
# per GPU, tokens dispatched by all-to-all in FP8 bytes). Local checkpoints every 100 iterations go to LOCAL_CKPT_DIR
# [/tmp/megafp8_local_ckpt] on each node (docs/checkpoints.md, "Non-persistent checkpoints").
#
# Install on the GPU machine (its own CUDA build of torch first): pip install -e ".[data,tensorboard]"
#
# Environment (defaults in brackets): NNODES [2], NODE_RANK [0], MASTER [localhost], NPROC_PER_NODE [8],
# DATA_PATH [data/text_document] (a preprocessed prefix, docs/data.md), TOKENIZER [models/tokenizer] (a Hugging Face
# tokenizer directory), RUN_DIR [runs/deepseek_v3_recipe], TRAIN_ITERS [50000], GLOBAL_BATCH_SIZE [512] (x 4096
# tokens = 2M). Rerunning resumes from RUN_DIR's latest checkpoint; --load reshards (experts too, across EP sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
MASTER="${MASTER:-localhost}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
DATA_PATH="${DATA_PATH:-data/text_document}"
TOKENIZER="${TOKENIZER:-models/tokenizer}"
RUN_DIR="${RUN_DIR:-runs/deepseek_v3_recipe}"
TRAIN_ITERS="${TRAIN_ITERS:-50000}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}"
mkdir -p "$RUN_DIR"

# The Llama block, said as Megatron-LM's scripts say it: RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)
# The first layer dense, the other 26 MoE (Megatron-LM's --moe-layer-freq list, as 0/1 per layer).
MOE_LAYERS="0$(printf ',1%.0s' $(seq 26))"

flags=(
  "${LLAMA_BLOCK[@]}"
  --num-layers 27 --hidden-size 2048 --ffn-hidden-size 11264 --num-attention-heads 16 --kv-channels 128
  --group-query-attention --num-query-groups 4
  --seq-length 4096 --max-position-embeddings 4096 --rotary-base 50000 --norm-epsilon 1e-6
  --untie-embeddings-and-output-weights --init-method-std 0.006 --make-vocab-size-divisible-by 128
  # mixture of experts: DeepSeek-V3's router and balancing, shared experts
  --num-experts 64 --moe-layer-freq "$MOE_LAYERS" --moe-ffn-hidden-size 1408 --moe-router-topk 6
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-shared-expert-intermediate-size 2816 --moe-token-dispatcher-type alltoall
  # layout: TP2 (SP) x DP for the dense part; the experts over EP 8
  --tensor-model-parallel-size 2 --sequence-parallel
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce
  --distributed-timeout-minutes 30
  # precision: bf16, FP8 GEMMs with DeepSeek-V3's blockwise scaling (1x128 / 128x128, power-of-two scales)
  --bf16 --fp8-format e4m3 --fp8-recipe blockwise --fp8-power-of-2-scale
  # optimizer and schedule
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
  --lr 4.2e-4 --min-lr 4.2e-5 --lr-warmup-iters 2000 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
  # data
  --data-path "$DATA_PATH" --split 990,9,1 --seed 1234
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --eval-interval 1000 --eval-iters 5
  # checkpoints and logs: persistent every 1000, node-local every 100 (resumed from when newer)
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000 --keep-last 3
  --non-persistent-save-interval 100 --non-persistent-ckpt-type local
  --non-persistent-local-ckpt-dir "${LOCAL_CKPT_DIR:-/tmp/megafp8_local_ckpt}"
  --log-interval 10 --log-dir "$RUN_DIR/logs" --tensorboard-dir "$RUN_DIR/tensorboard"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1  # kernels in issue order: communication overlaps as scheduled
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id deepseek_v3_recipe \
  -m megafp8.pretrain "${flags[@]}"
