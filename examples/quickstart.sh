#!/usr/bin/env bash
# Quickstart on one CPU machine (minutes, no downloads): the whole product on the embedded default.
#   1. a corpus from this machine's Python standard library sources
#   2. a SentencePiece tokenizer trained on it
#   3. Megatron-compatible .bin/.idx data
#   4. 3D-parallel FP8 training with torchrun: 8 processes = TP 2 x PP 2 x DP 2, sequence parallel, FP8
#      hybrid delayed scaling, the ZeRO distributed optimizer with FP8 parameter all-gather; it stops and
#      saves part-way (as a preempted job would), then
#   5. resumes from the checkpoint for the rest of the run.
#
#   bash examples/quickstart.sh [WORKDIR]        (default WORKDIR: ./runs/quickstart)
#   QUICKSTART_ITERS=N  total iterations (default 60; the first run stops at 2/3 of them)
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/quickstart}"
iters="${QUICKSTART_ITERS:-60}"
mkdir -p "$work"

echo "== 1/5 corpus: Python stdlib sources -> $work/stdlib.jsonl =="
python tools/build_corpus.py --output "$work/stdlib.jsonl" --max-bytes 4000000

echo "== 2/5 tokenizer: SentencePiece BPE, 4000 pieces -> $work/tok.model =="
python tools/train_tokenizer.py --input "$work/stdlib.jsonl" --model-prefix "$work/tok" --vocab-size 4000

echo "== 3/5 preprocess: -> $work/stdlib_text_document.bin/.idx (Megatron MMIDIDX) =="
python tools/preprocess_data.py --input "$work/stdlib.jsonl" --output-prefix "$work/stdlib" --json-keys text \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/tok.model" --append-eod --workers 2

# The Llama block, said as Megatron-LM's Llama scripts say it (Megatron's defaults describe a GPT-3 block, which
# megafp8 refuses): RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)

flags=(
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  "${LLAMA_BLOCK[@]}"
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4
  --group-query-attention --num-query-groups 2 --seq-length 128
  --micro-batch-size 2 --global-batch-size 16 --train-iters "$iters"
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
  --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max
  --use-distributed-optimizer --fp8-param-gather --overlap-grad-reduce --overlap-param-gather
  --data-path "$work/stdlib_text_document" --split 98,2,0
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/tok.model"
  --eval-interval 20 --eval-iters 2 --log-interval 5
  --save "$work/checkpoints" --save-interval 20 --keep-last 2
  --log-dir "$work/logs" --tensorboard-dir "$work/tensorboard"
)
# gloo on CPU: one intra-op thread per process, 8 processes share the machine's cores.
export OMP_NUM_THREADS=1

echo "== 4/5 train: TP2 x PP2 x DP2, FP8, stopping at iteration $((iters * 2 / 3)) (as if preempted) =="
torchrun --standalone --nproc-per-node 8 -m megafp8.pretrain "${flags[@]}" --exit-interval $((iters * 2 / 3))

echo "== 5/5 resume from $work/checkpoints to iteration $iters =="
torchrun --standalone --nproc-per-node 8 -m megafp8.pretrain "${flags[@]}" --load "$work/checkpoints"

echo
echo "checkpoints: $work/checkpoints (latest: $(cat "$work/checkpoints/latest_checkpointed_iteration.txt"))"
echo "metrics:     $work/logs/metrics.jsonl"
echo "tensorboard: tensorboard --logdir $work/tensorboard"
