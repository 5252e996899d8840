#!/usr/bin/env bash
# One-shot GPU check for a lent Hopper machine (torch + triton preinstalled, no network, no pip install):
# the kernel tests compiled on CUDA (including the `gpu`-marked ones), then the GEMM/quantize benchmark.
# Budget: under 6 minutes on one H200. Results land in $OUT (or ./gpu_check_out) for docs/benchmarks.md.
#   bash tools/bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
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
# The tests compile many GEMM specializations: skip the autotuning sweep there (the benchmark tunes).
MEGAFP8_GEMM_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_kernels_quantize.py tests/test_kernels_gemm.py tests/test_fp8_linear.py 2>&1 | tee "$out/pytest.txt"
tests_rc=$?
timeout 200 python3 tools/bench/bench_gemm.py --json "$out/bench_gemm.json" 2>&1 | tee "$out/bench_gemm.md"
bench_rc=$?
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
