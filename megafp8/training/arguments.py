"""The training entry's flags, with Megatron-LM's names, and their validation before any process-group work.

`parse_args(argv, world_size)` returns an argparse Namespace whose fields are the flag names with
underscores (Megatron's convention, so `Fp8Recipe.from_args` and `ModelConfig` read it directly), plus
a few derived fields (`data_parallel_size`, `num_micro_batches`, `train_samples`). Every problem is
reported at once, each line naming its flag, as one `ArgumentError`.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence

from megafp8.fp8.recipe import FORMATS, FP4_SCALINGS, scaling_names
from megafp8.model.config import ACTIVATIONS, rope_scaling_flag
from megafp8.model.recompute import GRANULARITIES, METHODS, recompute_errors
from megafp8.model.rotary import Llama3RopeScaling
from megafp8.optim.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES
from megafp8.training import megatron_flags
from megafp8.training.compilation import add_compile_flags, compile_errors
from megafp8.training.non_persistent import add_non_persistent_flags, non_persistent_errors
from megafp8.training.rerun_flags import add_rerun_flags, fill_rerun_mode, rerun_errors
from megafp8.optim.loss_scaler import loss_scale_errors
from megafp8.training.block_flags import add_block_flags, block_errors
from megafp8.training.microscaling_flags import (add_microscaling_flags, fill_microscaling_defaults,
                                                 microscaling_errors)
from megafp8.training.moe_flags import add_moe_flags, expert_tensor_parallel_size, moe_flag_errors
from megafp8.training.profiling import profile_errors

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
CP_COMM_TYPES = ("p2p", "all_gather")
TOKENIZERS = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


class ArgumentError(ValueError):
    """Invalid flags; the message lists every problem, one per line, each naming its flag."""


class _HelpFormatter(argparse.HelpFormatter):
    """One help line per flag, plus its default where it has a value (a switch's False/True default would read
    backwards for `--no-...` flags, and None means "derived", which the help text says)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.nargs != 0 and not no_default and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """Every flag with its one line of help: the source of `--help`, tools/print_flags.py and docs/training.md."""
    p = argparse.ArgumentParser(prog="megafp8-pretrain", description="Megatron-style 3D-parallel FP8 pretraining.",
                                formatter_class=_HelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2,
                   help="transformer layers (the Llama block: RMSNorm, RoPE attention with GQA, SwiGLU MLP; say so with "
                        "the flags below, as Megatron-LM's Llama scripts do)")
    g.add_argument("--hidden-size", type=int, default=64, help="model width h")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP inner width f (default: Megatron-LM's SwiGLU rule, 8/3 h rounded down to a multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="query heads; head dim = h / heads unless --kv-channels")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads, with --group-query-attention (Megatron-LM ignores it without)")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="RoPE table length (default --seq-length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the embedding is padded to a multiple of this x TP (padding rows are zero and never saved)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="RMSNorm epsilon")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE theta (Llama 3: 500000)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.1 RoPE frequency scaling (HF rope_type llama3): long wavelengths divided by "
                        "--rope-scaling-factor, short ones kept, a smooth band between")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling: context extension factor (Llama-3.1: 8, Llama-3.2 1B/3B: 32)")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="with --use-rope-scaling: wavelengths over original length / this are scaled fully")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="with --use-rope-scaling: wavelengths under original length / this are kept")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="with --use-rope-scaling: the context length the model was pretrained at (Megatron-LM "
                        "hard-codes these three values: 1, 4, 8192)")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal initialisation (output projections scaled by 1/sqrt(2 layers)); the "
                        "same values at every layout, drawn per (seed, parameter name)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (default: tied to the embedding)")
    g.add_argument("--activation", choices=ACTIVATIONS, default=None,
                   help="swiglu (what --swiglu builds), smooth_swiglu (per-channel power-of-two scaling before "
                        "FC2's FP8 cast, docs/fp8.md), or xielu (FOG's non-gated MLP with the trainable xIELU "
                        "activation; --ffn-hidden-size defaults to 4h)")
    add_block_flags(g)
    megatron_flags.add_model_flags(g)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP: attention heads and MLP columns split over this many ranks (docs/parallelism.md)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP: layers split into this many stages")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved schedule: each rank holds several chunks of this many layers")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first stage when the split is uneven (e.g. to balance the embedding)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last stage (the output layer and loss live there)")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default=None,
                   help="1f1b, interleaved (default with virtual stages, else 1f1b), interleaved-zb (interleaved "
                        "with the weight-gradient pass split off to fill bubbles), zbv, dualpipev (zero-bubble V "
                        "schedules); docs/parallelism.md 'Which schedule when'")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: each sequence split over this many ranks (2 x CP chunks, load-balanced for causal "
                        "attention; K/V exchanged in a ring); CP ranks share the ZeRO shards with DP "
                        "(docs/parallelism.md)")
    g.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default="p2p",
                   help="how CP ranks exchange K/V: p2p (a ring of sends overlapped with each block's attention) "
                        "or all_gather (all K/V gathered once per layer)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP > 1: norms, residuals and activations between the TP regions are split over the "
                        "sequence (all-gather / reduce-scatter instead of all-reduce, in FP8 where the next GEMM is "
                        "FP8); at TP 1 it is turned off with a warning, as in Megatron-LM")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: gradients reduce-scattered and optimizer state sharded over DP (docs/optimizer.md)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each gradient bucket as soon as its last gradient is ready, overlapping backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather the updated parameters bucket by bucket under the next forward (distributed "
                        "optimizer)")
    g.add_argument("--fp8-grad-reduce", action="store_true",
                   help="distributed optimizer with FP8: the gradient buckets of FP8 layers travel as FP8 (one scale "
                        "per parameter and piece agreed over DP, an all-to-all, a local fp32 sum) instead of a "
                        "reduce-scatter in the buffer's precision (docs/optimizer.md)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="the gradient buffer and its reduction in bf16 instead of fp32")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: one bucket per kind of parameter)")
    g.add_argument("--recompute-granularity", choices=GRANULARITIES, default=None,
                   help="full (recompute whole layers in backward) or selective (only the attention core)")
    g.add_argument("--recompute-method", choices=METHODS, default=None,
                   help="with full: uniform (groups of N layers) or block (the first N layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="the N of --recompute-method")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="every collective and pipeline send/receive fails after this long instead of hanging")
    g.add_argument("--hang-timeout-minutes", type=float, default=None,
                   help="an iteration (or save, or evaluation) running longer than this writes every rank's stacks "
                        "and collectives under --log-dir and names the ranks the others wait on (default 5 on GPUs, "
                        "off on CPU; 0: off); must be below --distributed-timeout-minutes")

    g = p.add_argument_group("precision and FP8")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and compute (GPU; on CPU only the flag checks, parameters stay fp32); "
                        "without it and --fp8-format the run is fp32")
    g.add_argument("--fp8-format", choices=FORMATS, default=None,
                   help="turns FP8 GEMMs on: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients, as in "
                        "TransformerEngine)")
    # The registry's recipes (built-ins + registered) but the FP4 ones, which --fp4-recipe names (Megatron-LM's split).
    g.add_argument("--fp8-recipe", choices=[n for n in scaling_names() if n not in FP4_SCALINGS], default="delayed",
                   help="how each FP8 tensor is scaled (docs/training.md 'The recipes', docs/fp8.md)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling: amaxes remembered per tensor (the scale comes from their max)")
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default="most_recent",
                   help="delayed scaling: max of the history or the most_recent amax")
    g.add_argument("--fp8-margin", type=int, default=0, help="scales are divided by 2^margin (headroom against growth)")
    g.add_argument("--fp8-static-grad-scale", type=float, default=1.0,
                   help="--fp8-recipe static: the fixed scale of the gradients' casts (a power of two; activations and "
                        "weights use 1). A mean loss over T tokens makes gradients ~1/T: about T keeps them in range")
    g.add_argument("--fp8-power-of-2-scale", action="store_true",
                   help="round every scale to a power of two (exact rescaling, as DeepSeek-V3 / torchao can)")
    g.add_argument("--no-fp8-fprop-fast-accum", dest="fp8_fprop_fast_accum", action="store_false",
                   help="accumulate the forward GEMM (x W^T) with fp32 promotion like dgrad/wgrad, instead of the tensor "
                        "core's fast accumulation over all of K (TransformerEngine's default; docs/fp8.md)")
    g.add_argument("--fp8-gemm-autotune", action="store_true",
                   help="tune the Triton FP8 GEMM's launch config per shape on each rank (results cached in "
                        "TRITON_CACHE_DIR for the next process) instead of the audited default config")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="the distributed optimizer casts its shard of each FP8 layer's weight to FP8 and the DP "
                        "all-gather moves FP8 bytes; the layers keep no high-precision weight copy, except a layer "
                        "the saturation guard moved to high precision (docs/optimizer.md)")
    g.add_argument("--fp8-dot-product-attention", action="store_true",
                   help="attention's Q·Kᵀ and P·V (and backward's GEMMs) in FP8, softmax in fp32, in every layer whose "
                        "QKV projection runs FP8 (TransformerEngine's fp8_dpa; docs/fp8.md 'FP8 attention')")
    g.add_argument("--first-last-layers-bf16", type=int, nargs="?", const=1, default=0,
                   help="keep the first and last N transformer layers (N = 1 when given without a value) out of FP8")
    g.add_argument("--log-fp8-telemetry", action="store_true",
                   help="on logged iterations: per layer and tensor role the amax, scale, saturated and "
                        "flushed-to-zero fractions, and each FP8 layer's input kurtosis and RMS, to TensorBoard "
                        "(kurtosis also to metrics.jsonl)")
    g.add_argument("--kurtosis-warning-ratio", type=float, default=2.0,
                   help="with --log-fp8-telemetry: warn when a layer's input kurtosis reaches this multiple of its "
                        "lowest over the last --kurtosis-warning-window logs (FOG's early sign of divergence)")
    g.add_argument("--kurtosis-warning-window", type=int, default=5,
                   help="how many previous logged kurtosis values the warning compares with")
    g.add_argument("--no-fp8-saturation-guard", dest="fp8_saturation_guard", action="store_false",
                   help="turn the saturation guard off: no layer ever leaves FP8, and the guard's per-step telemetry "
                        "pass is saved")
    g.add_argument("--fp8-saturation-guard-threshold", type=float, default=0.01,
                   help="the guard counts a step against a layer when any of its FP8 tensors has more than this "
                        "fraction saturated")
    g.add_argument("--fp8-saturation-guard-patience", type=int, default=3,
                   help="consecutive such steps before the layer moves to high precision")
    g.add_argument("--fp8-saturation-guard-kurtosis", action="store_true",
                   help="with --log-fp8-telemetry: the guard also moves a layer to high precision (one step down its "
                        "ladder) at its kurtosis warning, before its casts saturate; the kurtosis is then that of the "
                        "stage's whole batch (moments summed over TP x CP x DP), so every rank switches together")
    g.add_argument("--fp8-self-check", action="store_true",
                   help="given alone: check this machine's FP8 kernels (quantize + GEMM per scale mode) against "
                        "fp64, print OK or FAIL per mode and exit (status 1 on a FAIL); no training")

    megatron_flags.add_precision_flags(g)

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="the floor the decay ends at")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear",
                   help="cosine, linear, constant, inverse-square-root, WSD (warmup-stable-decay: hold --lr, then "
                        "anneal over the last --lr-wsd-decay-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="warm-up length in iterations (with --train-iters)")
    g.add_argument("--lr-warmup-samples", type=int, default=None,
                   help="warm-up length in samples (with --train-samples)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay length in iterations (default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay length in samples (default --train-samples)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: length of the final anneal in iterations")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD: length of the final anneal in samples")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential", help="WSD anneal shape")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm (over all ranks) to this; 0 disables")
    g.add_argument("--master-weight-dtype", choices=("fp32", "fp16"), default="fp32",
                   help="the optimizer's copy of the weights: fp32, or fp16 with a power-of-two scale per tensor "
                        "(distributed optimizer)")
    g.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "fp8"), default="fp32",
                   help="Adam moments in fp32, bf16 or fp8 (E4M3 codes with per-128-group scales; distributed "
                        "optimizer)")

    megatron_flags.add_schedule_flags(g)

    g = p.add_argument_group("training and data")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward/backward on one rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all DP ranks; a multiple of micro batch x DP, the quotient "
                        "being the micro-batches per step (gradient accumulation, and the pipeline's micro-batch "
                        "count); default micro batch x DP")
    g.add_argument("--train-iters", type=int, default=None, help="run length in iterations ...")
    g.add_argument("--train-samples", type=int, default=None, help="... or in samples (exclusive with --train-iters)")
    g.add_argument("--seed", type=int, default=1234,
                   help="the seed of initialisation, data order and RNG streams; with the consumed-sample count it "
                        "fixes the data order (a resumed run reads exactly what the straight run would)")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="a preprocessed prefix, or WEIGHT PREFIX WEIGHT PREFIX ... to blend datasets (docs/data.md)")
    g.add_argument("--split", default="969,30,1",
                   help="train, validation, test weights of each dataset's documents")
    g.add_argument("--tokenizer-type", choices=TOKENIZERS, default="SentencePieceTokenizer",
                   help="SentencePieceTokenizer, HuggingFaceTokenizer or NullTokenizer (data already ids); sets the "
                        "vocabulary size")
    g.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer file (SentencePiece .model, HF tokenizer.json) or HF model directory")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="the vocabulary for NullTokenizer (it adds one end-of-document id)")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="evaluate on the validation split every this many iterations")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches per evaluation (0: no evaluation)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after an iteration that is a multiple of this (saving first when --save is set)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (and save) once the run has lasted this long; all ranks agree on the iteration")

    megatron_flags.add_training_flags(g)
    megatron_flags.add_data_flags(g)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None,
                   help="directory to save to: iter_NNNNNNN/ and latest_checkpointed_iteration.txt "
                        "(docs/checkpoints.md); also saved at the end of the run and on every exit condition")
    g.add_argument("--load", default=None,
                   help="directory to resume from (its latest complete checkpoint); a missing or empty one starts "
                        "from iteration 0 and says so, so --load and --save may name the same directory")
    g.add_argument("--save-interval", type=int, default=None, help="save every this many iterations")
    g.add_argument("--keep-last", type=int, default=None, help="keep only the newest N checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="the saving step only copies the state to host memory; a background thread writes and "
                        "commits it while training goes on (docs/checkpoints.md)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights: iteration 0, a fresh optimizer, data from the start, and "
                        "math-changing flags may differ")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the weights (they become the master weights) but not the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--allow-changed-args", nargs="+", default=None, metavar="FLAG",
                   help="math-changing flags (e.g. lr clip-grad) that may differ from the checkpoint's on --load "
                        "(the run then continues with the new values)")

    add_non_persistent_flags(g)
    megatron_flags.add_checkpoint_flags(g)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1,
                   help="print the console line (and write a metrics record) every this many iterations")
    g.add_argument("--log-dir", default=None, help="write DIR/metrics.jsonl")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard scalars (train/lm_loss, train/lr, train/grad_norm, train/tokens_per_s, "
                        "train/tflops_per_device, train/model_state_bytes_per_param, validation/lm_loss, and "
                        "fp8/<layer>/... with --log-fp8-telemetry); needs the tensorboard package")
    g.add_argument("--profile", action="store_true",
                   help="write a torch.profiler Chrome trace of iterations --profile-step-start+1 .. "
                        "--profile-step-end on --profile-ranks to <--log-dir or --tensorboard-dir>/profile/")
    g.add_argument("--profile-step-start", type=int, default=10, help="iterations done before the trace starts")
    g.add_argument("--profile-step-end", type=int, default=12, help="iterations done when the trace stops")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], metavar="RANK", help="global ranks to profile")
    megatron_flags.add_logging_flags(g)

    add_compile_flags(p.add_argument_group("compile and CUDA graphs"))
    add_microscaling_flags(p.add_argument_group("microscaling and FP4"))
    add_moe_flags(p.add_argument_group("mixture of experts"))
    add_rerun_flags(p.add_argument_group("suspicious steps (result checks and re-runs)"))
    megatron_flags.add_implementation_flags(p.add_argument_group("Megatron-LM implementation choices (accepted)"))
    return p


def _print_warning(message: str) -> None:
    print(f"megafp8-pretrain: warning: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1,
               warn: Callable[[str], None] | None = _print_warning) -> argparse.Namespace:
    """Parse and validate; fills the derived fields. Raises ArgumentError listing every problem.
    ``warn`` receives each lenient fix-up (Megatron's rules, e.g. --sequence-parallel at TP 1); None: silent."""
    args, errors, warnings = parse_and_check(argv, world_size)
    if errors:
        raise ArgumentError("invalid arguments:\n" + "\n".join(f"  - {e}" for e in errors))
    for message in warnings if warn is not None else ():
        warn(message)
    return args


def parse_and_check(argv: Sequence[str] | None = None, world_size: int = 1) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(args with the derived fields, every problem, the warnings of lenient fix-ups); raises only for what
    argparse itself rejects (an unknown flag, a malformed value: SystemExit 2 with argparse's message)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    warnings = _fill_defaults(args, world_size)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return args, argument_errors(args, world_size) + block_errors(args, given) + microscaling_errors(args, given) \
        + moe_flag_errors(args) + rerun_errors(args, given) + non_persistent_errors(args), \
        warnings


def _fill_defaults(args: argparse.Namespace, world_size: int) -> list[str]:
    """Derived fields and Megatron-LM's lenient rules; returns a warning for each flag it overrode."""
    warnings = []
    fill_rerun_mode(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # Megatron-LM's validate_args: sequence parallelism is meaningless without TP, so it is switched off
        # (a launch script that always passes it, or a TP-1 resume of a TP-2 run, keeps working).
        args.sequence_parallel = False
        warnings.append("--sequence-parallel turned off: it needs --tensor-model-parallel-size > 1 "
                        "(Megatron-LM does the same)")
    megatron_flags.fill_megatron_defaults(args)
    fill_microscaling_defaults(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # CP ranks read the same samples: data parallelism is what TP x CP x PP leaves of the world.
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * max(args.context_parallel_size, 1))
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel if model_parallel > 0 and world_size % model_parallel == 0 else 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * max(args.data_parallel_size, 1)
    if args.pipeline_schedule is None:
        args.pipeline_schedule = "interleaved" if args.num_layers_per_virtual_pipeline_stage else "1f1b"
    if args.train_samples is None and args.train_iters is not None:
        args.train_samples = args.train_iters * args.global_batch_size
    per_step = args.micro_batch_size * max(args.data_parallel_size, 1)
    divisible = per_step > 0 and args.global_batch_size % per_step == 0
    args.num_micro_batches = args.global_batch_size // per_step if divisible else 0  # 0: reported by argument_errors
    return warnings


def argument_errors(args: argparse.Namespace, world_size: int) -> list[str]:
    """Every flag problem this Namespace has, one message each, the parallel layout's included
    (megafp8.parallel.parallel_state.layout_errors, which names its flags too)."""
    errors: list[str] = []
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval",
                "eval_interval", "fp8_amax_history_len", "train_iters", "train_samples", "num_query_groups",
                "ffn_hidden_size", "num_layers_per_virtual_pipeline_stage", "distributed_timeout_minutes",
                "context_parallel_size")
    for name in positive:
        if name == "train_samples" and args.train_iters is not None:
            continue  # derived from --train-iters, whose own message covers it
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    # The layout's rules assume positive sizes (they would only repeat those messages); the run's length,
    # intervals and the like do not enter them, so a bad --train-iters still gets the layout checked.
    layout_sizes = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                    "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "num_query_groups", "ffn_hidden_size", "num_layers_per_virtual_pipeline_stage",
                    "context_parallel_size")
    sizes_ok = all(getattr(args, name) is None or getattr(args, name) > 0 for name in layout_sizes)
    for name in ("save_interval", "keep_last", "exit_interval", "eval_iters", "lr_warmup_iters",
                 "ddp_bucket_size", "recompute_num_layers", "lr_warmup_samples", "lr_decay_iters", "lr_decay_samples",
                 "lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "fp8_margin", "first_last_layers_bf16"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            errors.append(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    # A NaN passes every comparison above (and --clip-grad nan silently meant no clipping): floats are finite.
    float_flags = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.type is float}
    for dest, flag in float_flags.items():
        value = getattr(args, dest, None)
        if value is not None and not math.isfinite(value):
            errors.append(f"{flag} must be a finite number, got {value}")
    for name in ("norm_epsilon", "rotary_base", "init_method_std"):
        value = getattr(args, name)
        if math.isfinite(value) and value <= 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.data_path:
        from megafp8.data.splits import parse_split

        try:
            parse_split(args.split)
        except ValueError as e:
            errors.append(str(e))
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if sizes_ok:
        from megafp8.parallel.parallel_state import layout_errors

        errors += layout_errors(
            world_size=world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
            cp=args.context_parallel_size, vpp_layers=args.num_layers_per_virtual_pipeline_stage, sequence_parallel=args.sequence_parallel,
            num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            kv_channels=args.kv_channels, seq_length=args.seq_length, global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size, pipeline_schedule=args.pipeline_schedule,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers, ep=args.expert_model_parallel_size,
            etp=expert_tensor_parallel_size(args))
    hang = hang_timeout_minutes(args)
    if args.hang_timeout_minutes is not None and args.hang_timeout_minutes < 0:
        errors.append(f"--hang-timeout-minutes must be >= 0 (0: off), got {args.hang_timeout_minutes}")
    elif hang and args.distributed_timeout_minutes and hang >= args.distributed_timeout_minutes:
        errors.append(f"--hang-timeout-minutes ({hang:g}) must be below --distributed-timeout-minutes "
                      f"({args.distributed_timeout_minutes}): the watchdog reports before the collectives time out")
    if args.train_iters is None and args.train_samples is None:
        errors.append("give the training length: --train-iters or --train-samples")
    elif args.train_iters is not None and args.train_samples != args.train_iters * args.global_batch_size:
        errors.append("--train-iters and --train-samples are exclusive: give one")
    elif args.train_iters is None:  # counted in samples: the schedule flags must be too
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            errors.append("--lr-warmup-iters/--lr-decay-iters go with --train-iters; with --train-samples use "
                          "--lr-warmup-samples/--lr-decay-samples")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if args.lr_warmup_samples is not None and args.lr_warmup_iters:
        errors.append("--lr-warmup-iters and --lr-warmup-samples are exclusive")
    if not 0 <= args.fp8_saturation_guard_threshold < 1:
        errors.append(f"--fp8-saturation-guard-threshold must be in [0, 1), got {args.fp8_saturation_guard_threshold}")
    if args.fp8_saturation_guard_patience < 1:
        errors.append(f"--fp8-saturation-guard-patience must be >= 1, got {args.fp8_saturation_guard_patience}")
    errors += loss_scale_errors(args)
    if args.fp8_saturation_guard_kurtosis:
        if not args.fp8_saturation_guard:
            errors.append("--fp8-saturation-guard-kurtosis acts through the saturation guard: drop "
                          "--no-fp8-saturation-guard")
        if not args.log_fp8_telemetry:
            errors.append("--fp8-saturation-guard-kurtosis needs --log-fp8-telemetry (the kurtosis is measured on "
                          "logged iterations)")
        if args.expert_model_parallel_size > 1:
            errors.append("--fp8-saturation-guard-kurtosis is not built with --expert-model-parallel-size > 1 (the "
                          "ranks of a stage hold different experts, so their moments cannot be summed)")
        if (args.expert_tensor_parallel_size or 1) > 1:
            errors.append("--fp8-saturation-guard-kurtosis is not built with --expert-tensor-parallel-size > 1 (the "
                          "ranks of an expert's ETP group see the same gathered rows: a stage-wide sum counts them "
                          "twice)")
    if not args.kurtosis_warning_ratio > 1 or args.kurtosis_warning_window < 1:
        errors.append(f"--kurtosis-warning-ratio must be > 1 and --kurtosis-warning-window >= 1, got "
                      f"{args.kurtosis_warning_ratio} and {args.kurtosis_warning_window}")
    if args.fp8_param_gather and args.fp8_format is None:
        errors.append("--fp8-param-gather needs --fp8-format")
    if args.fp8_param_gather and not args.use_distributed_optimizer:
        errors.append("--fp8-param-gather needs --use-distributed-optimizer (the owner of each shard casts it to FP8)")
    if args.fp8_format is None and (args.first_last_layers_bf16 or args.log_fp8_telemetry
                                    or not args.fp8_saturation_guard):
        flag = ("--first-last-layers-bf16" if args.first_last_layers_bf16 else
                "--log-fp8-telemetry" if args.log_fp8_telemetry else "--no-fp8-saturation-guard")
        errors.append(f"{flag} needs --fp8-format")
    if args.fp8_grad_reduce and args.fp8_format is None:
        errors.append("--fp8-grad-reduce needs --fp8-format")
    if args.fp8_grad_reduce and not args.use_distributed_optimizer:
        errors.append("--fp8-grad-reduce needs --use-distributed-optimizer (each rank sums its shard's FP8 pieces)")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer")
    if (args.master_weight_dtype != "fp32" or args.optimizer_state_dtype != "fp32") and not args.use_distributed_optimizer:
        errors.append("--master-weight-dtype/--optimizer-state-dtype other than fp32 need --use-distributed-optimizer")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.pipeline_schedule != "1f1b" and args.pipeline_model_parallel_size == 1:
        errors.append(f"--pipeline-schedule {args.pipeline_schedule} needs --pipeline-model-parallel-size > 1")
    errors += recompute_errors(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    errors += _rope_scaling_errors(args)
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type not in ("NullTokenizer", "GPT2BPETokenizer") and args.data_path and args.tokenizer_model is None:
        errors.append(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    if args.data_path is None and not args.mock_data:
        errors.append("--data-path is required (a preprocessed prefix; see docs/data.md), or --mock-data")
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and args.load is None:
            errors.append(f"--{flag.replace('_', '-')} needs --load")
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save")
    if args.allow_changed_args is not None:
        from megafp8.checkpoint.args_check import MATH_ARGS

        if args.load is None:
            errors.append("--allow-changed-args needs --load")
        unknown = [f for f in args.allow_changed_args if f.lstrip("-").replace("-", "_") not in MATH_ARGS]
        if unknown:
            errors.append(f"--allow-changed-args {' '.join(unknown)}: not a flag a checkpoint checks; those are "
                          + " ".join(sorted(n.replace("_", "-") for n in MATH_ARGS)))
    if args.fp8_self_check:
        errors.append("--fp8-self-check runs alone: give it without other flags")
    schedule_flags = ("--lr", "--min-lr", "--train-", "--global-batch-size", "--micro-batch-size", "--lr-")
    if not any(flag in e for e in errors for flag in schedule_flags):  # else its message would blame another flag
        errors += _schedule_errors(args)
    errors += megatron_flags.megatron_flag_errors(args)
    errors += optional_package_errors(args)
    errors += profile_errors(args, world_size)
    errors += compile_errors(args)
    return errors


def _rope_scaling_errors(args: argparse.Namespace) -> list[str]:
    """Unusable --rope-scaling-* values, or ones set without --use-rope-scaling (they would be ignored)."""
    scaling = Llama3RopeScaling(**{field: getattr(args, f"rope_scaling_{field}") for field in Llama3RopeScaling.FIELDS})
    if args.use_rope_scaling:
        return scaling.errors(rope_scaling_flag)
    return [f"{rope_scaling_flag(field)} {getattr(scaling, field)} needs --use-rope-scaling"
            for field in Llama3RopeScaling.FIELDS if getattr(scaling, field) != getattr(Llama3RopeScaling(), field)]


def _schedule_errors(args: argparse.Namespace) -> list[str]:
    """The LR schedule's own rules (--min-lr within [0, --lr], warm-up shorter than the decay, ...)."""
    from megafp8.training.schedules import learning_rate_schedule

    try:
        learning_rate_schedule(args)
    except ValueError as e:
        return [str(e)]
    return []


# Packages a flag needs that `pip install megafp8` does not bring: {flag dest: (flag, import name, pip name)}.
OPTIONAL_PACKAGES = {"tensorboard_dir": ("--tensorboard-dir", "tensorboard", "tensorboard"),
                     "wandb_project": ("--wandb-project", "wandb", "wandb")}


def optional_package_errors(args: argparse.Namespace) -> list[str]:
    """A flag whose package is not installed, in one line with the pip command (checked before any process
    group: a missing package must not kill one rank mid-run and the others with it)."""
    return [f"{flag} needs the {package} package, which is not installed: pip install {pip_name}"
            for dest, (flag, package, pip_name) in OPTIONAL_PACKAGES.items()
            if getattr(args, dest) is not None and importlib.util.find_spec(package) is None]


def hang_timeout_minutes(args: argparse.Namespace) -> float:
    """--hang-timeout-minutes, or its default: on a GPU machine 5 minutes (half of --distributed-timeout-minutes if
    that is shorter), off on CPU (0)."""
    if args.hang_timeout_minutes is not None:
        return args.hang_timeout_minutes
    import torch

    return min(5.0, args.distributed_timeout_minutes / 2) if torch.cuda.is_available() else 0.0
