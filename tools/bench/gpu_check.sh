#!/usr/bin/env bash
# One-shot GPU check for a lent Hopper machine (torch + triton preinstalled, no network, no pip install).
usage() {
  cat <<'EOF'
usage: bash tools/bench/gpu_check.sh [--help]

Runs, in one go, on a machine with a CUDA GPU (budget: under 6 minutes on one H200; the four steps'
timeouts, 120 + 45 + 110 + 75 s, add up to 350 s):
  1. the kernel and FP8 linear tests compiled on CUDA, `gpu`-marked ones included
     (MEGAFP8_GEMM_AUTOTUNE=0: one fixed config per specialization; pytest-xdist -n 12 if installed);
  2. tools/bench/kernel_resources.py: n_regs / n_spills / shared memory of every GEMM launch config
     and the quantize kernels, each GEMM checked against the reference twin;
  3. tools/bench/bench_gemm.py: FP8 GEMM TFLOP/s (Triton, torch._scaled_mm, bf16) and quantize GB/s;
  4. tools/bench/bench_train.py: end-to-end training of a ~1B Llama, bf16 vs FP8 tensorwise/delayed (and the
     compressed ZeRO preset), 5 iterations each (2 untimed): tokens/s, TFLOP/s, MFU, peak memory.
Results go to $OUT (or ./gpu_check_out): env.txt, pytest.txt, resources.md/.json, bench_gemm.md/.json,
bench_train.md/.json.
Exits 0 when every step passed; 1 when a step failed or no CUDA GPU is visible (then nothing runs).
EOF
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac
set -uo pipefail
cd "$(dirname "$0")/../.."

# Stop before doing anything on a machine without a usable GPU.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi missing or failing); nothing was run" >&2
  exit 1
fi
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: python3's torch sees no CUDA device (CPU-only build or driver mismatch); nothing was run" >&2
  exit 1
fi

out="${OUT:-gpu_check_out}"
mkdir -p "$out"
# The package is not installed there: expose kernels/ under its import name without pip.
shim="$(mktemp -d)"
ln -s "$PWD/kernels" "$shim/megafp8_kernels"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
} 2>&1 | tee "$out/env.txt"

# 1. Tests. They compile a few hundred GEMM specializations (dtype pairs x modes x epilogues): spread
#    the compiles over the CPU cores with xdist when it is there.
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)  # 12 of the 16 cores: one GEMM test case per worker
MEGAFP8_GEMM_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} \
  tests/test_kernels_quantize.py tests/test_kernels_gemm.py tests/test_fp8_linear.py 2>&1 | tee "$out/pytest.txt"
tests_rc=$?

# 2. Registers and spills of the compiled kernels.
timeout 45 python3 tools/bench/kernel_resources.py --json "$out/resources.json" 2>&1 | tee "$out/resources.md"
resources_rc=$?

# 3. Throughput (autotuned GEMMs).
timeout 110 python3 tools/bench/bench_gemm.py --json "$out/bench_gemm.json" 2>&1 | tee "$out/bench_gemm.md"
bench_rc=$?

# 4. End-to-end training through megafp8.pretrain (the full six-run table: python tools/bench/bench_train.py).
timeout 75 python3 tools/bench/bench_train.py --iters 5 --warmup 2 \
  --only "high precision" "fp8 tensorwise" "fp8 delayed" --json "$out/bench_train.json" 2>&1 | tee "$out/bench_train.md"
train_rc=$?

echo "gpu_check: tests rc=$tests_rc, resources rc=$resources_rc, bench rc=$bench_rc, train rc=$train_rc" \
  "(124 = step timed out)"
exit $(( tests_rc || resources_rc || bench_rc || train_rc ))
