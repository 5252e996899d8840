#!/usr/bin/env bash
# FP8 parity: the same small Llama, seed and data order in high precision and in every FP8 mode, then the
# numerics report (tools/fp8_report.py): loss vs tokens, gap to the baseline, grad norm, per-layer telemetry.
#   runs: fp32 (baseline), fp8_delayed (hybrid), fp8_tensorwise, fp8_rowwise, fp8_blockwise,
#         fp8_zero_compressed (ZeRO: FP8 optimizer state + fp16 master + FP8 param gather, delayed),
#         fp8_delayed_smooth_swiglu (the Smooth-SwiGLU ablation of fp8_delayed),
#         fp8_overflow_guarded / fp8_overflow_unguarded (the saturation guard in practice: fp8_delayed with
#         layers.0.mlp.linear_fc2's input forced to overflow from 1/5 of the run on by the test hook
#         MEGAFP8_FORCE_FP8_OVERFLOW (megafp8/fp8/forced_overflow.py), with the guard and without it),
#         fp8_zero_dp2 / fp8_grad_reduce (DP=2 under torchrun, half the micro-batch, the same global batch: FP8
#         delayed + ZeRO, without and with --fp8-grad-reduce; the report compares the pair, 0.5% band),
#         mxfp8 (E4M3, E8M0 scale per 32), nvfp4 (--fp4-format e2m1: stochastic rounding, Hadamard wgrad, 16x16
#         weights) and its ablations nvfp4_no_sr / nvfp4_no_rht / nvfp4_no_2d (one part off each), mxfp4
#         (emulated on CPU: the numerics of Blackwell's block-scaled GEMMs, not their speed), and NVFP4's
#         precision schedule: nvfp4_then_bf16 (the last 20% of the run in high precision) and nvfp4_fprop_bf16
#         (the NVFP4 paper's variant: only the forward GEMMs switch) and nvfp4_grad_noise ("FP4 All the Way"'s
#         switch: once the FP4 wgrads' norm falls below sqrt(3) x their quantization noise, probed every log
#         interval); the architectures for FP8: fog_fp32 /
#         fog_fp8 (FOG's block), mus_fp32 / mus_static (μnit Scaling with static casts), and FP8 attention in the
#         Llama (fp8_attention) and in FOG's block (fog_fp8_attention); mixture of experts with the dense MLP's
#         active parameters (4 experts of half its width, top-2): moe_fp32 (softmax router, aux loss 1e-2),
#         moe_blockwise (the same in FP8 blockwise, DeepSeek-V3's recipe) and moe_bias_fp32 (DeepSeek-V3's sigmoid
#         router with the aux-loss-free expert bias)
#
#   bash examples/fp8_parity.sh [--quick] [WORKDIR]     (default WORKDIR: ./runs/fp8_parity)
#   --quick: 40 steps of a 2-layer Llama (CI); default: 500 steps of a 4-layer one on a larger corpus and
#   tokenizer (~5 minutes on 2 CPU cores). Both: hidden 128, 4 heads, 64-token samples, 8 per step.
#   PARITY_ITERS=N        iterations per run (a multiple of the log interval, 5 quick / 10 full)
#   PARITY_MODEL="..."    model flags replacing the default ones (e.g. a smaller model for a test; the Llama block
#                         flags are added to them)
#   PARITY_RUNS="a b"     only these runs (the first one is the baseline)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == "--quick" ]]; then quick=1; shift; fi
work="${1:-runs/fp8_parity}"
mkdir -p "$work"

if (( quick )); then
  iters="${PARITY_ITERS:-40}"; corpus_bytes=1000000; vocab=1000; eval_interval=20; log_interval=5
  model="${PARITY_MODEL:---num-layers 2 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 8}"
else
  iters="${PARITY_ITERS:-500}"; corpus_bytes=4000000; vocab=2000; eval_interval=100; log_interval=10
  model="${PARITY_MODEL:---num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 64 --micro-batch-size 8 --global-batch-size 8}"
fi
seq_length=$(sed -n 's/.*--seq-length \([0-9]*\).*/\1/p' <<< "$model")
micro_batch=$(sed -n 's/.*--micro-batch-size \([0-9]*\).*/\1/p' <<< "$model")

if [[ ! -f "$work/stdlib_text_document.idx" ]]; then
  echo "== data: Python stdlib corpus, SentencePiece ($vocab pieces), Megatron .bin/.idx in $work =="
  python tools/build_corpus.py --output "$work/stdlib.jsonl" --max-bytes "$corpus_bytes"
  python tools/train_tokenizer.py --input "$work/stdlib.jsonl" --model-prefix "$work/tok" --vocab-size "$vocab"
  python tools/preprocess_data.py --input "$work/stdlib.jsonl" --output-prefix "$work/stdlib" --json-keys text \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/tok.model" --append-eod --workers 2
fi

# The Llama block, said as Megatron-LM's Llama scripts say it (Megatron's defaults describe a GPT-3 block, which
# megafp8 refuses): RMSNorm, SwiGLU, RoPE, no linear biases, no dropout.
LLAMA_BLOCK=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
             --attention-dropout 0 --hidden-dropout 0)
# shellcheck disable=SC2206  # the model flags are meant to split into words
common=(
  "${LLAMA_BLOCK[@]}" $model --train-iters "$iters" --seed 1234
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters $((iters / 20 + 1)) --lr-decay-style cosine --weight-decay 0.1
  --adam-beta2 0.95 --clip-grad 1.0 --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --data-path "$work/stdlib_text_document" --split 98,2,0
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/tok.model"
  --eval-interval "$eval_interval" --eval-iters 4 --log-interval "$log_interval"
)
fp8="--fp8-format hybrid --fp8-recipe"
fog="--no-pre-norm --post-norm --qk-layernorm --freeze-qk-layernorm --activation xielu"
ffn=$(sed -n 's/.*--ffn-hidden-size \([0-9]*\).*/\1/p' <<< "$model")
moe_common="--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size $((ffn / 2))"
moe="$moe_common --moe-aux-loss-coeff 1e-2"
moe_bias="$moe_common --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-aux-loss-coeff 0"
mus="--unit-scaling --residual-tau 0.2 --post-norm --no-pre-norm --lr 3e-2 --min-lr 3e-3"
declare -A run_flags=(
  [fp32]=""
  [fp8_delayed]="$fp8 delayed"
  [fp8_tensorwise]="$fp8 tensorwise"
  [fp8_rowwise]="$fp8 rowwise"
  [fp8_blockwise]="$fp8 blockwise"
  [fp8_zero_compressed]="$fp8 delayed --use-distributed-optimizer --fp8-param-gather --master-weight-dtype fp16 --optimizer-state-dtype fp8"
  [fp8_delayed_smooth_swiglu]="$fp8 delayed --activation smooth_swiglu"
  [fp8_overflow_guarded]="$fp8 delayed"
  [fp8_overflow_unguarded]="$fp8 delayed --no-fp8-saturation-guard"
  [fp8_zero_dp2]="$fp8 delayed --use-distributed-optimizer --micro-batch-size $((micro_batch / 2))"
  [fp8_grad_reduce]="$fp8 delayed --use-distributed-optimizer --micro-batch-size $((micro_batch / 2)) --fp8-grad-reduce"
  [mxfp8]="--fp8-format e4m3 --fp8-recipe mxfp8"
  [nvfp4]="--fp4-format e2m1 --fp4-recipe nvfp4"
  [nvfp4_no_sr]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-no-stochastic-rounding"
  [nvfp4_no_rht]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-no-hadamard"
  [nvfp4_no_2d]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-no-2d-weights"
  [mxfp4]="--fp4-format e2m1 --fp4-recipe mxfp4"
  [nvfp4_then_bf16]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-until-fraction 0.8"
  [nvfp4_fprop_bf16]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-until-fraction 0.8 --fp4-switch-gemms fprop"
  [nvfp4_grad_noise]="--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-until-grad-noise"
  # The architectures for FP8 (docs/training.md), each against its own fp32 run (--pair below): FOG's block with
  # xIELU, and the μnit Scaling model (unit-scale weights move by the learning rate itself: 10x the Llama's) with
  # static FP8 casts.
  [fog_fp32]="$fog"
  [fog_fp8]="$fog $fp8 delayed"
  [mus_fp32]="$mus"
  [mus_static]="$mus $fp8 static --fp8-static-grad-scale 512"
  # FP8 attention (--fp8-dot-product-attention) in the Llama, where FOG saw divergence, and in FOG's block.
  [fp8_attention]="$fp8 delayed --fp8-dot-product-attention"
  [fog_fp8_attention]="$fog $fp8 delayed --fp8-dot-product-attention"
  # Mixture of experts (docs/parallelism.md): the dense MLP's active parameters in 4 experts of half its width, top 2.
  [moe_fp32]="$moe"
  [moe_blockwise]="$moe --fp8-format e4m3 --fp8-recipe blockwise --fp8-power-of-2-scale"
  [moe_bias_fp32]="$moe_bias"
)
dp2="-m torch.distributed.run --standalone --nproc-per-node 2"
declare -A run_launch=([fp8_zero_dp2]="$dp2" [fp8_grad_reduce]="$dp2")
overflow="MEGAFP8_FORCE_FP8_OVERFLOW=layers.0.mlp.linear_fc2@$((iters / 5))"
declare -A run_env=([fp8_overflow_guarded]="$overflow" [fp8_overflow_unguarded]="$overflow")
runs="${PARITY_RUNS:-fp32 fp8_delayed fp8_tensorwise fp8_rowwise fp8_blockwise fp8_zero_compressed fp8_delayed_smooth_swiglu fp8_overflow_guarded fp8_overflow_unguarded fp8_zero_dp2 fp8_grad_reduce mxfp8 nvfp4 nvfp4_no_sr nvfp4_no_rht nvfp4_no_2d mxfp4 nvfp4_then_bf16 nvfp4_fprop_bf16 nvfp4_grad_noise fog_fp32 fog_fp8 mus_fp32 mus_static fp8_attention fog_fp8_attention moe_fp32 moe_blockwise moe_bias_fp32}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

mkdir -p "$work/runs"
dirs=()
for name in $runs; do
  dir="$work/runs/$name"
  rm -rf "$dir"  # metrics.jsonl appends: a rerun starts clean
  echo "== $name: $iters iterations -> $dir =="
  start=$SECONDS
  telemetry=()
  if [[ "${run_flags[$name]}" == *-format* ]]; then telemetry=(--log-fp8-telemetry); fi  # FP8/FP4 runs only
  # shellcheck disable=SC2086  # the run's flags are meant to split into words
  env ${run_env[$name]:-} python ${run_launch[$name]:-} -m megafp8.pretrain "${common[@]}" ${run_flags[$name]} \
      --log-dir "$dir" --tensorboard-dir "$dir/tb" "${telemetry[@]}" > "$dir.log" 2>&1 \
    || { echo "$name failed; its output: $dir.log" >&2; tail -5 "$dir.log" >&2; exit 1; }
  echo "   done in $((SECONDS - start)) s: $(grep 'validation loss' "$dir.log" | tail -1)"
  grep 'switched to' "$dir.log" | sed 's/^ */   /' || true  # the saturation guard's switches
  dirs+=("$dir")
done

pairs=()
for pair in fp8_grad_reduce=fp8_zero_dp2 fog_fp8=fog_fp32 mus_static=mus_fp32 fog_fp8_attention=fog_fp32 \
            moe_blockwise=moe_fp32; do
  if [[ " $runs " == *" ${pair%%=*} "* && " $runs " == *" ${pair##*=} "* ]]; then pairs+=(--pair "$pair"); fi
done
python tools/fp8_report.py "${dirs[@]}" --output "$work/report" --seq-length "$seq_length" "${pairs[@]}"
