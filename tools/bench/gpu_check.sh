#!/usr/bin/env bash
# One-shot GPU check for a lent Hopper machine (torch + triton preinstalled, no network, no pip install).
usage() {
  cat <<'USAGE'
usage: bash tools/bench/gpu_check.sh [--help] [--dry-run] [--steps LIST] [--cpu-precompile [--shards I,J,...]]

Runs on a machine with a CUDA GPU, in under 6 minutes on one H200 (the step budgets below add up to
360 s). Every step runs in isolation under its own timeout; one failing does not stop the others:
  precompile  (60 s)  tools/bench/kernel_audit.py in 8 parallel shards (balanced by tools/bench/audit_shards.py):
                      every GEMM config, quantize, fused RMSNorm/SwiGLU cast and fused optimizer kernel compiled for
                      sm_90a into this run's Triton cache, and every kernel training launches at bench_train's and the
                      8B examples' exact shapes (so no later step compiles them inside its time), with registers,
                      spills (n_spills), wgmma.wait_group and TMA per kernel; fails only on a regression (a compile
                      error, a spill outside the audit's known ones, marked "known" in its table);
  tests       (65 s)  the kernel, fused-prologue and FP8 linear tests on CUDA against their twins, the in-cast
                      telemetry counts, the promotion order, the on-device model build, the guard's pinned-memory
                      flags, the fused optimizer kernels against their twins (the default GEMM config, no tuning;
                      xdist -n 12 if present, pytest.ini's options replaced (-o addopts=); skipped with a reason
                      if the image has no pytest: installs nothing);
  gemm        (40 s)  tools/bench/bench_gemm.py: FP8 GEMM TFLOP/s (Triton, torch._scaled_mm, bf16), quantize GB/s;
  wgrad       (25 s)  bench_gemm.py --wgrad: wgrad into fp32 main_grad, Triton accumulate vs _scaled_mm + add_;
  gluon       (15 s)  bench_gemm.py --gemm-only with MEGAFP8_GEMM_PRECISE_KERNEL=gluon (the precise path with a
                      wgmma group in flight, kernels/gemm_hopper.py): compare its rows with the gemm step's;
  casts       (10 s)  bench_gemm.py --quantize-only with one K tile per cast program (launch 1,32,16,4; the
                      default takes 4): compare its GB/s with the gemm step's quantize rows;
  microscaling (15 s) tools/bench/bench_block_scaled.py: MXFP8 / MXFP4 / NVFP4 block-scaled GEMM TFLOP/s beside
                      BF16, and their quantize + transposed copy GB/s; "native" on Blackwell (sm_100a), "emulated (BF16
                      upcast)" on Hopper, where these recipes are for numerics studies, not speed;
  train      (130 s)  tools/bench/bench_train.py: a ~1B Llama, 16k tokens per step, bf16 vs FP8 delayed and blockwise
                      eager, then bf16 and FP8 delayed under --compile and FP8 delayed under --enable-cuda-graph
                      (exact --only names), 4 iterations each, 2 untimed (the compile lands in them), and a fifth
                      under --profile: its Chrome trace in profiles/<run>.json.gz (where the step's time goes).
Each step's row in steps.tsv also counts the kernels it compiled (new cubins in the Triton cache): after the
precompile step, tests compile only their own small shapes, and train should compile nothing.
--steps LIST      comma-separated subset of: precompile,tests,gemm,wgrad,gluon,casts,microscaling,train (default: all,
                  in order)
--dry-run         print each step's command and budget, run nothing (works without a GPU)
--cpu-precompile  no GPU needed: run the precompile step's audit shards on this CPU under the GPU image's Triton
                  (3.6.0, from the side venv tools/bench/triton_side_venv.sh makes), the shards one after another,
                  then a table of each shard's wall and CPU seconds: the CPU seconds are what the GPU host, running
                  the 8 in parallel on 16 cores, takes per shard, to hold against the step's budget. --shards
                  I,J,... runs only those shards (default: all 8).
Results go to $OUT (or ./gpu_check_out): env.txt, one file per step, steps.tsv and the one table
summary.md (each step's result and time, then the benchmark tables).
Exits 0 when every step passed; 1 when a step failed or no CUDA GPU is visible (then nothing runs);
2 on a bad argument; 3 when --cpu-precompile cannot download the Triton 3.6.0 wheel for its side venv.
USAGE
}
ALL_STEPS="precompile,tests,gemm,wgrad,gluon,casts,microscaling,train"
steps="$ALL_STEPS" dry_run=0 cpu_precompile=0 shards="0,1,2,3,4,5,6,7"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --cpu-precompile) cpu_precompile=1 ;;
    --steps)
      [ $# -ge 2 ] || { echo "gpu_check: --steps needs a value (e.g. --steps gemm,train)" >&2; exit 2; }
      steps="$2"; shift ;;
    --shards)
      [ $# -ge 2 ] || { echo "gpu_check: --shards needs a value (e.g. --shards 0,5)" >&2; exit 2; }
      shards="$2"; shift ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for s in ${steps//,/ }; do
  case ",$ALL_STEPS," in *",$s,"*) ;; *) echo "gpu_check: --steps: unknown step '$s' (choose from $ALL_STEPS)" >&2; exit 2 ;; esac
done
for i in ${shards//,/ }; do
  case "$i" in [0-7]) ;; *) echo "gpu_check: --shards: '$i' is not a shard of 8 (0-7)" >&2; exit 2 ;; esac
done
set -uo pipefail
cd "$(dirname "$0")/../.."

# Each step: name, budget in seconds, output file, command (run by bash -c under `timeout`).
# Budgets (sum 360 s): the precompile shards' compile seconds measured on a 2-core CPU under Triton 3.6 (the slowest
# of 8 balanced shards; docs/benchmarks.md "gpu_check budgets", checked by tests/test_gpu_check_budget.py), then the
# timed steps, which compile nothing of their own but the tests' small shapes.
step_budget() { case "$1" in precompile) echo 60 ;; tests) echo 65 ;; gemm) echo 40 ;; wgrad) echo 25 ;; gluon) echo 15 ;; casts) echo 10 ;; microscaling) echo 15 ;; train) echo 130 ;; esac; }
PRECOMPILE_SHARD_COUNT=8
# The test files and node ids of the tests step (tests/test_gpu_check_budget.py checks each one exists).
TESTS_STEP_IDS="tests/test_kernels_quantize.py tests/test_moe.py::test_grouped_gemm_in_bf16_on_cuda_equals_the_loop_of_linears tests/test_kernels_grouped_gemm.py tests/test_moe_grouped_fp8.py::test_grouped_fp8_experts_with_the_triton_kernel_follow_the_loop tests/test_quantize_stats.py tests/test_kernels_gemm.py tests/test_gemm_promotion.py tests/test_kernels_norm_quantize.py tests/test_fp8_linear.py tests/test_init_on_device.py tests/test_rotary_table_length.py tests/test_fp8_guard_device.py tests/test_ring_attention.py::test_blocks_merged_by_lse_equal_full_attention tests/test_fp8_attention.py::test_triton_forward_on_cuda_matches_the_twin tests/test_optim_fused_step.py::test_kernels_equal_their_twins tests/test_optim_fused_coded.py::test_e4m3_rounding_equals_torchs_cast tests/test_optim_fused_coded.py::test_fp16_stochastic_rounding_equals_the_twin tests/test_optim_fused_coded.py::test_reproducible_log2_exp2 tests/test_optim_fused_coded.py::test_fp16_master_publication_equals_the_slab_decode"
step_command() {
  case "$1" in
    precompile)
      # On the GPU host the shards run in parallel (16 cores); with --cpu-precompile one after another, so that each
      # shard's seconds are its own.
      local run_shard='"$AUDIT_PYTHON" tools/bench/kernel_audit.py --shard $i/'"$PRECOMPILE_SHARD_COUNT"' --json "$OUT_DIR/audit$i.json" > "$OUT_DIR/audit$i.md" 2>&1'
      if [ "$cpu_precompile" = 1 ]; then run_shard+=' || rc=1;'; else run_shard+=' &'; fi
      echo 'rc=0; for i in '"${shards//,/ }"'; do '"$run_shard"' done; for j in $(jobs -p); do wait $j || rc=1; done; cat "$OUT_DIR"/audit?.md; exit $rc' ;;
    tests) echo 'python3 -c "import pytest" 2>/dev/null || { echo "tests: SKIPPED: pytest is not installed in this image (this step installs nothing)"; exit 0; }; xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 12); python3 -m pytest -o addopts= -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} '"$TESTS_STEP_IDS" ;;
    gemm) echo 'python3 tools/bench/bench_gemm.py --json "$OUT_DIR/bench_gemm.json"' ;;
    wgrad) echo 'python3 tools/bench/bench_gemm.py --wgrad --json "$OUT_DIR/bench_wgrad.json"' ;;
    gluon) echo 'MEGAFP8_GEMM_PRECISE_KERNEL=gluon python3 tools/bench/bench_gemm.py --gemm-only --json "$OUT_DIR/bench_gemm_gluon.json"' ;;
    casts) echo 'python3 tools/bench/bench_gemm.py --quantize-only --quantize-launch 1,32,16,4 --json "$OUT_DIR/bench_casts_1tile.json"' ;;
    microscaling) echo 'python3 tools/bench/bench_block_scaled.py --json "$OUT_DIR/bench_block_scaled.json"' ;;
    train) echo 'python3 tools/bench/bench_train.py --iters 4 --warmup 2 --timeout 14 --compile-timeout 28 --only "high precision (bf16)" "fp8 delayed" "fp8 blockwise" "high precision (bf16) + compile" "fp8 delayed + compile" "fp8 delayed + cuda graph" --json "$OUT_DIR/bench_train.json" --profile-dir "$OUT_DIR/profiles"' ;;
  esac
}
if [ "$dry_run" = 1 ]; then
  [ "$cpu_precompile" = 1 ] && steps=precompile
  for s in ${steps//,/ }; do echo "$s ($(step_budget "$s") s): $(step_command "$s")"; done
  exit 0
fi

# Counts the compiled kernels (cubins) in the Triton cache: the difference across a step is what it compiled.
cubins() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

if [ "$cpu_precompile" = 1 ]; then
  # No GPU: the precompile step on this CPU, under the GPU image's Triton from the side venv.
  AUDIT_PYTHON="$(bash tools/bench/triton_side_venv.sh --version 3.6.0)"
  rc=$?
  AUDIT_PYTHON="${AUDIT_PYTHON##*$'\n'}"  # its last line is the venv's python
  if [ "$rc" != 0 ] || [ ! -x "$AUDIT_PYTHON" ]; then
    echo "gpu_check: --cpu-precompile: no side venv with triton 3.6.0 (triton_side_venv.sh exit $rc)" >&2
    [ "$rc" = 3 ] && exit 3  # the wheel could not be downloaded
    exit 1
  fi
  export AUDIT_PYTHON
  out="${OUT:-gpu_check_out}"
  mkdir -p "$out"
  export OUT_DIR="$(cd "$out" && pwd)" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
  export TRITON_CACHE_DIR="$OUT_DIR/triton_cache"
  unset TRITON_INTERPRET
  { date -u +"date: %Y-%m-%dT%H:%MZ"; echo "cpu: $(nproc) cores, no GPU (--cpu-precompile, shards ${shards})"
    "$AUDIT_PYTHON" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
  } 2>&1 | tee "$out/env.txt"
  start=$SECONDS before=$(cubins)
  bash -c "$(step_command precompile)" > "$out/precompile.md" 2>&1
  rc=$?
  grep -E "^(FAIL|KNOWN) " "$out/precompile.md" | head -n 40
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' precompile "$rc" "$((SECONDS - start))" "$(step_budget precompile)" precompile.md \
    "$(( $(cubins) - before ))" > "$out/steps.tsv"
  "$AUDIT_PYTHON" tools/bench/gpu_check_table.py "$out" > /dev/null
  "$AUDIT_PYTHON" tools/bench/gpu_check_table.py --shard-seconds "$out"
  exit $rc
fi
AUDIT_PYTHON=python3
export AUDIT_PYTHON

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
export OUT_DIR="$(cd "$out" && pwd)"
# The package is not installed there: expose kernels/ under its import name without pip.
shim="$(mktemp -d)"
ln -s "$PWD/kernels" "$shim/megafp8_kernels"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
export TRITON_CACHE_DIR="$OUT_DIR/triton_cache"  # the precompile step fills it; later steps reuse it
unset TRITON_INTERPRET
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
} 2>&1 | tee "$out/env.txt"

: > "$out/steps.tsv"
failed=0
for s in ${steps//,/ }; do
  budget="$(step_budget "$s")" start=$SECONDS before=$(cubins)
  echo "== $s (budget ${budget} s)"
  timeout --kill-after=5 "$budget" bash -c "$(step_command "$s")" > "$out/$s.md" 2>&1
  rc=$?
  tail -n 30 "$out/$s.md"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "$rc" "$((SECONDS - start))" "$budget" "$s.md" "$(( $(cubins) - before ))" \
    >> "$out/steps.tsv"
  [ "$rc" = 0 ] || failed=1
done
python3 tools/bench/gpu_check_table.py "$out"
exit $failed
