#!/usr/bin/env bash
# FP8 pretraining of a ~1B Llama-style model on one GPU (e.g. one H100/H200 with 80+ GB).
#
#   DATA_PATH=runs/quickstart/stdlib_text_document TOKENIZER=runs/quickstart/tok.model \
#   bash examples/pretrain_single_gpu.sh
#
# Llama-3.2-1B's transformer (16 layers, hidden 2048, FFN 8192, 32 heads in 8 KV groups), sequence 2048; bf16 with FP8 GEMMs
# (hybrid E4M3/E5M2, delayed scaling). Micro batch 4, global batch 64 (16 gradient-accumulation steps).
# One data-parallel rank still uses the distributed optimizer: it is what keeps the FP8 weights and the
# compressed optimizer state (fp16 master weights, FP8 Adam moments, bf16 gradients: docs/optimizer.md),
# about 7 bytes per parameter instead of 18.
#
# Install on the GPU machine (its own CUDA build of torch first): pip install -e ".[data,tensorboard]"
# (the tokenizer and TensorBoard packages these flags use; plain `pip install -e .` installs neither).
#
# Environment (defaults in brackets): DATA_PATH [runs/quickstart/stdlib_text_document], TOKENIZER
# [runs/quickstart/tok.model] (SentencePiece; set TOKENIZER_TYPE=HuggingFaceTokenizer for a HF one),
# RUN_DIR [runs/single_gpu], TRAIN_ITERS [20000]. Rerunning the command resumes from RUN_DIR/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_PATH="${DATA_PATH:-runs/quickstart/stdlib_text_document}"
TOKENIZER="${TOKENIZER:-runs/quickstart/tok.model}"
TOKENIZER_TYPE="${TOKENIZER_TYPE:-SentencePieceTokenizer}"
RUN_DIR="${RUN_DIR:-runs/single_gpu}"
TRAIN_ITERS="${TRAIN_ITERS:-20000}"
mkdir -p "$RUN_DIR"

# The Llama block, said as Megatron-LM's Llama scripts say it (Megatron's defaults describe a GPT-3 block, which
# megafp8 refuses): RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)

flags=(
  "${LLAMA_BLOCK[@]}"
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
  --group-query-attention --num-query-groups 8
  --seq-length 2048 --rotary-base 500000 --untie-embeddings-and-output-weights
  --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --use-distributed-optimizer --fp8-param-gather --grad-reduce-in-bf16
  --master-weight-dtype fp16 --optimizer-state-dtype fp8
  --micro-batch-size 4 --global-batch-size 64 --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
  --data-path "$DATA_PATH" --split 990,9,1 --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER"
  --eval-interval 500 --eval-iters 10
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 500 --keep-last 2
  --log-interval 10 --log-dir "$RUN_DIR/logs" --tensorboard-dir "$RUN_DIR/tensorboard"
)

torchrun --standalone --nproc-per-node 1 -m megafp8.pretrain "${flags[@]}"
