"""The training entry's flags, with Megatron-LM's names, and their validation before any process-group work.

`parse_args(argv, world_size)` returns an argparse Namespace whose fields are the flag names with
underscores (Megatron's convention, so `Fp8Recipe.from_args` and `ModelConfig` read it directly), plus
a few derived fields (`data_parallel_size`, `num_micro_batches`, `train_samples`). Every problem is
reported at once, each line naming its flag, as one `ArgumentError`.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from megafp8.fp8.recipe import FORMATS, SCALINGS
from megafp8.model.config import ACTIVATIONS
from megafp8.model.recompute import GRANULARITIES, METHODS, recompute_errors
from megafp8.optim.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
TOKENIZERS = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


class ArgumentError(ValueError):
    """Invalid flags; the message lists every problem, one per line, each naming its flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megafp8-pretrain", description="Megatron-style 3D-parallel FP8 pretraining.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: Llama's 8/3 x hidden, rounded to 64")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA; default: one per head (MHA)")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--activation", choices=ACTIVATIONS, default="swiglu")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default=None,
                   help="default: interleaved with --num-layers-per-virtual-pipeline-stage, else 1f1b")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per gradient bucket")
    g.add_argument("--recompute-granularity", choices=GRANULARITIES, default=None)
    g.add_argument("--recompute-method", choices=METHODS, default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("precision and FP8")
    g.add_argument("--bf16", action="store_true", help="BF16 compute; without it (and without FP8) the run is fp32")
    g.add_argument("--fp8-format", choices=FORMATS, default=None, help="enables FP8 GEMMs")
    g.add_argument("--fp8-recipe", choices=SCALINGS, default="delayed")
    g.add_argument("--fp8-amax-history-len", type=int, default=1024)
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default="max")
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--fp8-power-of-2-scale", action="store_true")
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--first-last-layers-bf16", type=int, nargs="?", const=1, default=0,
                   help="keep the first and last N transformer layers out of FP8")
    g.add_argument("--log-fp8-telemetry", action="store_true")
    g.add_argument("--no-fp8-saturation-guard", dest="fp8_saturation_guard", action="store_false",
                   help="never move a saturating layer to high precision (saves the guard's per-step telemetry pass)")
    g.add_argument("--fp8-saturation-guard-threshold", type=float, default=0.01,
                   help="saturated fraction of a layer's FP8 tensor above which a check counts against it")
    g.add_argument("--fp8-saturation-guard-patience", type=int, default=3,
                   help="consecutive checks above the threshold before the layer moves to high precision")

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: length of the final anneal")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD: the anneal in samples")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--master-weight-dtype", choices=("fp32", "fp16"), default="fp32")
    g.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "fp8"), default="fp32")

    g = p.add_argument_group("training and data")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-path", nargs="+", default=None, help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=TOKENIZERS, default="SentencePieceTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for --tokenizer-type NullTokenizer")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last", type=int, default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-dir", default=None, help="writes DIR/metrics.jsonl")
    g.add_argument("--tensorboard-dir", default=None)
    return p


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> argparse.Namespace:
    """Parse and validate; fills the derived fields. Raises ArgumentError listing every problem."""
    args = build_parser().parse_args(argv)
    _fill_defaults(args, world_size)
    errors = argument_errors(args, world_size)
    if errors:
        raise ArgumentError("invalid arguments:\n" + "\n".join(f"  - {e}" for e in errors))
    return args


def _fill_defaults(args: argparse.Namespace, world_size: int) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 64 * -(-(8 * args.hidden_size // 3) // 64)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
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


def argument_errors(args: argparse.Namespace, world_size: int) -> list[str]:
    """Every flag problem this Namespace has, one message each (the layout itself is validated by
    ParallelState, which also names its flags)."""
    errors: list[str] = []
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval",
                "eval_interval", "fp8_amax_history_len")
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("train_iters", "train_samples", "save_interval", "keep_last", "exit_interval", "eval_iters",
                 "ddp_bucket_size", "recompute_num_layers", "lr_warmup_samples", "lr_decay_iters", "lr_decay_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            errors.append(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if model_parallel > 0 and world_size % model_parallel:
        errors.append(f"the world size ({world_size}) must be divisible by --tensor-model-parallel-size "
                      f"({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
                      f"({args.pipeline_model_parallel_size})")
    elif args.data_parallel_size and args.num_micro_batches == 0:
        errors.append(f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
                      f"({args.micro_batch_size}) x data parallel size ({args.data_parallel_size})")
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
    if args.fp8_param_gather and args.fp8_format is None:
        errors.append("--fp8-param-gather needs --fp8-format")
    if args.fp8_param_gather and not args.use_distributed_optimizer:
        errors.append("--fp8-param-gather needs --use-distributed-optimizer (the owner of each shard casts it to FP8)")
    if args.fp8_format is None and (args.first_last_layers_bf16 or args.log_fp8_telemetry
                                    or not args.fp8_saturation_guard):
        flag = ("--first-last-layers-bf16" if args.first_last_layers_bf16 else
                "--log-fp8-telemetry" if args.log_fp8_telemetry else "--no-fp8-saturation-guard")
        errors.append(f"{flag} needs --fp8-format")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer")
    if (args.master_weight_dtype != "fp32" or args.optimizer_state_dtype != "fp32") and not args.use_distributed_optimizer:
        errors.append("--master-weight-dtype/--optimizer-state-dtype other than fp32 need --use-distributed-optimizer")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.pipeline_schedule != "1f1b" and args.pipeline_model_parallel_size == 1:
        errors.append(f"--pipeline-schedule {args.pipeline_schedule} needs --pipeline-model-parallel-size > 1")
    errors += recompute_errors(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type != "NullTokenizer" and args.data_path and args.tokenizer_model is None:
        errors.append(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    if args.data_path is None:
        errors.append("--data-path is required (a preprocessed prefix; see docs/data.md)")
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and args.load is None:
            errors.append(f"--{flag.replace('_', '-')} needs --load")
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save")
    return errors
