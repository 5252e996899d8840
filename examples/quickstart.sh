#!/usr/bin/env bash
# Quickstart on one CPU (minutes, no downloads): what megafp8 can run today, on the embedded default.
#   bash examples/quickstart.sh [WORKDIR]      (default WORKDIR: ./runs/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/quickstart}"
mkdir -p "$work"

echo "== FP8 kernels: quantize + GEMM against fp64, every scaling mode =="
torchrun --standalone --nproc-per-node 1 -m megafp8.pretrain
