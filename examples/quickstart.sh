#!/usr/bin/env bash
# Quickstart on one CPU (minutes, no downloads): what megafp8 can run today, on the embedded default —
# a corpus built from this machine's Python standard library, a SentencePiece tokenizer trained on it,
# Megatron-compatible .bin/.idx data, then the training entry point.
#   bash examples/quickstart.sh [WORKDIR]      (default WORKDIR: ./runs/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/quickstart}"
mkdir -p "$work"

echo "== 1/4 corpus: Python stdlib sources -> $work/stdlib.jsonl =="
python tools/build_corpus.py --output "$work/stdlib.jsonl" --max-bytes 4000000

echo "== 2/4 tokenizer: SentencePiece BPE, 8000 pieces -> $work/tok.model =="
python tools/train_tokenizer.py --input "$work/stdlib.jsonl" --model-prefix "$work/tok" --vocab-size 8000

echo "== 3/4 preprocess: -> $work/stdlib_text_document.bin/.idx (Megatron MMIDIDX) =="
python tools/preprocess_data.py --input "$work/stdlib.jsonl" --output-prefix "$work/stdlib" --json-keys text \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/tok.model" --append-eod --workers 2

echo "== 4/4 pretrain entry (FP8 kernel self-check until the training loop lands) =="
torchrun --standalone --nproc-per-node 1 -m megafp8.pretrain
