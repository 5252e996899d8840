"""Megatron-LM's flags with Megatron-LM's meaning and defaults: honoured, accepted as a description of what
megafp8 builds, or refused in one line naming the flag, its value, and what megafp8 supports.

The rule (docs/training.md "Megatron-LM's flags"): a launch script of Megatron-LM runs unchanged, only the
entry module differs, so a flag a script leaves out means what it means in Megatron-LM. Megatron's defaults
describe a GPT-3 block (LayerNorm, a GeLU MLP, learned positions, biases, dropout 0.1); megafp8 builds the Llama
block only, so a script must say so, as Megatron's own Llama scripts do: `--normalization RMSNorm --swiglu
--position-embedding-type rope --disable-bias-linear`, and dropout 0 (LLAMA_FLAGS below).
"""
from __future__ import annotations

import argparse

# What a Llama launch script of Megatron-LM says about the block (examples/llama/*.sh), as an argv.
LLAMA_FLAGS = ("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
               "--attention-dropout", "0", "--hidden-dropout", "0")

# Flags megafp8 has that Megatron-LM does not (tests/test_megatron_flags.py checks this list against the
# snapshot of Megatron-LM's parser, so a flag is either Megatron's, with its meaning, or listed here).
MEGAFP8_ONLY = frozenset({
    "--activation", "--rope-scaling-low-freq-factor", "--rope-scaling-high-freq-factor",
    "--rope-scaling-original-max-position-embeddings", "--pipeline-schedule", "--fp8-grad-reduce",
    "--fp8-power-of-2-scale", "--no-fp8-fprop-fast-accum", "--fp8-gemm-autotune", "--log-fp8-telemetry",
    "--no-fp8-saturation-guard", "--fp8-saturation-guard-threshold", "--fp8-saturation-guard-patience",
    "--fp8-saturation-guard-kurtosis",
    "--fp8-self-check", "--master-weight-dtype", "--optimizer-state-dtype", "--keep-last", "--allow-changed-args",
    "--log-dir", "--compile", "--mx-scale-rounding", "--fp4-no-stochastic-rounding", "--fp4-no-hadamard",
    "--fp4-no-2d-weights", "--fp4-guard-fallback", "--fp4-until-iteration", "--fp4-until-fraction",
    "--fp4-until-grad-noise", "--fp4-grad-noise-interval", "--fp4-grad-noise-threshold", "--fp4-switch-to",
    "--fp4-switch-gemms", "--kurtosis-warning-ratio", "--kurtosis-warning-window", "--no-pre-norm", "--post-norm",
    "--freeze-qk-layernorm", "--softmax-scale", "--embedding-scale", "--unit-scaling", "--residual-tau",
    "--allow-static-fp8-without-unit-scaling", "--fp8-static-grad-scale",
    # Megatron-LM dropped its --fp8-dot-product-attention (TransformerEngine reads NVTE_FP8_DPA now); the name stays.
    "--fp8-dot-product-attention",
    # NVIDIA Resiliency Extension's idea as a flag: the hang watchdog (megafp8/training/hang_watchdog.py).
    "--hang-timeout-minutes",
    # The result checks: Megatron-LM fixes the spike rule's 10 x max of 100 and has only the --no- spelling of the
    # NaN check; what a reproduced suspicious step does is megafp8's choice (megafp8/training/rerun.py).
    "--spiky-loss-factor", "--spiky-loss-samples", "--rerun-persistent-action", "--check-for-nan-in-loss-and-grad",
})

# Megatron flags megafp8 refuses whatever their value (docs/training.md lists them from here).
REFUSED_FLAGS = {
    "--squared-relu": "megafp8's MLP is SwiGLU (--swiglu)",
    "--openai-gelu": "megafp8's MLP is SwiGLU (--swiglu)",
    "--add-qkv-bias": "megafp8's QKV projection has no bias (Qwen2-style biases are not implemented)",
    "--rampup-batch-size": "batch-size ramp-up is not supported: the global batch is fixed for the run",
    "--step-batch-size-schedule": "batch-size schedules are not supported: the global batch is fixed for the run",
}

# Megatron flags megafp8 honours for some values only: {flag: the values refused, and why}.
REFUSED_VALUES = {
    "--cuda-graph-scope": "full_iteration: megafp8 captures per layer (full or attn)",
    "--normalization": "LayerNorm (Megatron-LM's default): megafp8 builds RMSNorm only",
    "--swiglu": "left out: Megatron-LM then builds a GeLU MLP, which megafp8 does not",
    "--disable-bias-linear": "left out: Megatron-LM then adds linear biases, which megafp8's layers do not have",
    "--position-embedding-type": "anything but rope (Megatron-LM's default is learned_absolute): megafp8 uses "
                                 "rotary embeddings only",
    "--rotary-percent": "anything but 1.0: megafp8 rotates every channel of a head",
    "--num-query-groups": "given without --group-query-attention: Megatron-LM ignores it (multi-head attention)",
    "--ckpt-format": "torch, fsdp_dtensor: megafp8 saves torch.distributed.checkpoint directories",
    "--attention-dropout": "with --context-parallel-size > 1 (not implemented in the ring attention)",
}

# Megatron flags whose megafp8 default differs, and why that cannot change a Megatron script's math: Megatron
# has no usable default there (the script must give it), or the flag does not touch the math.
DEFAULTS_THAT_DIFFER = {
    "--moe-token-dispatcher-type": "megafp8 defaults to alltoall (Megatron-LM to allgather): the same math, other bytes "
                                   "on the wire (both are built)",
    "--num-layers": "Megatron-LM requires it; megafp8's default is a tiny model for smoke runs",
    "--hidden-size": "Megatron-LM requires it",
    "--num-attention-heads": "Megatron-LM requires it",
    "--seq-length": "Megatron-LM requires it",
    "--micro-batch-size": "Megatron-LM requires it",
    "--lr": "Megatron-LM requires it (no default learning rate)",
    "--tokenizer-type": "Megatron-LM requires it",
    "--num-query-groups": "read only with --group-query-attention, where megafp8 also defaults to 1",
    "--split": "the same split: Megatron-LM fills in 969,30,1 after parsing",
    "--rerun-mode": "validate_results, Megatron-LM's default, is filled in after parsing (disabled under "
                    "--enable-cuda-graph: re-runs were not verified against CUDA graph replays)",
    "--lr-warmup-samples": "0 and None both mean no warm-up",
    "--no-load-optim": "None and False both mean load it",
    "--no-load-rng": "None and False both mean load it",
    "--eval-interval": "when to evaluate, not the training math",
    "--eval-iters": "how long an evaluation is, not the training math",
    "--log-interval": "when to log",
    "--profile-ranks": "which ranks trace",
    "--num-workers": "DataLoader worker processes; the batches are the same for every value",
    "--cp-comm-type": "Megatron-LM's takes one value per layer; megafp8 one for all, the same default",
}


def _switch(group, flag: str, help: str, dest: str | None = None, off: bool = False) -> None:
    """A Megatron switch; `off` for the `--no-...`/`--disable-...` kind, whose dest defaults to True."""
    kwargs = {"dest": dest} if dest else {}
    group.add_argument(flag, action="store_false" if off else "store_true", help=help, **kwargs)


def add_model_flags(g: argparse._ArgumentGroup) -> None:
    """The block's description in Megatron's words; defaults are Megatron-LM's (a GPT-3 block, refused)."""
    _switch(g, "--use-mcore-models", "accepted: megafp8's modules use Megatron-Core's layouts",
            dest="deprecated_use_mcore_models")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="RMSNorm (megafp8 builds no LayerNorm: Megatron-LM's default LayerNorm is refused)")
    _switch(g, "--apply-layernorm-1p", "zero-centred norm gains: stored as w, applied as 1 + w (initialised to 0); "
            "HF conversion writes 1 + w", dest="layernorm_zero_centered_gamma")
    _switch(g, "--swiglu", "SwiGLU MLP. Required: without it Megatron-LM builds a GeLU MLP, which megafp8 does not "
            "(or name the MLP with --activation)")
    _switch(g, "--squared-relu", "refused: megafp8's MLP is SwiGLU")
    _switch(g, "--openai-gelu", "refused: megafp8's MLP is SwiGLU")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "yarn", "mrope", "relative",
                                                         "none"), default="learned_absolute",
                   help="rope (the others, Megatron-LM's default learned_absolute included, are refused)")
    _switch(g, "--use-rotary-position-embeddings", "Megatron-LM's old spelling of --position-embedding-type rope")
    _switch(g, "--no-position-embedding", "accepted with rope (no learned position table either way)",
            dest="add_position_embedding", off=True)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's channels rotated; only 1.0 (Llama)")
    _switch(g, "--disable-bias-linear", "no biases in the linear layers. Required: Megatron-LM's default adds "
            "them, megafp8's layers have none", dest="add_bias_linear", off=True)
    _switch(g, "--add-qkv-bias", "refused: megafp8's QKV projection has no bias (Qwen2-style biases are not "
            "implemented)")
    _switch(g, "--qk-layernorm", "an RMSNorm on each query and key head before RoPE (Qwen3's q_norm / k_norm; HF "
            "conversion reads and writes Qwen3 checkpoints)")
    _switch(g, "--group-query-attention", "use --num-query-groups (Megatron-LM reads it only with this switch; "
            "then its default is 1)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dim d, when not hidden / heads (QKV is (heads + 2 groups) x d wide)")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout on the attention probabilities (Megatron-LM's default; Llama scripts pass 0); "
                        "TP ranks draw different masks, every draw follows --seed")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout on the attention and MLP outputs before each residual add (Megatron-LM's default; "
                        "Llama scripts pass 0)")


def add_precision_flags(g: argparse._ArgumentGroup) -> None:
    _switch(g, "--fp16", "fp16 parameters and compute (GPU; on CPU they stay fp32, the loss scaling runs) with "
            "Megatron-LM's loss scaling: dynamic, or --loss-scale's constant; non-finite steps are skipped")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a constant loss scale instead of the dynamic one")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                   help="--fp16: the dynamic loss scale's start (Megatron-LM's default 2^32)")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="--fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="--fp16: clean steps in a row that double the dynamic scale")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflowing steps the dynamic scale tolerates before it halves (restored when it "
                        "grows)")


def add_schedule_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as this fraction of the decay length (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak LR of the input embedding and the output layer (same schedule shape as --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help="with --decoupled-lr: their --min-lr")


def add_training_flags(g: argparse._ArgumentGroup) -> None:
    _switch(g, "--calculate-per-token-loss", "the loss is summed over micro-batches and ranks and divided by the "
            "global batch's loss tokens (not averaged per micro-batch): the same at every layout")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="refused: the global batch is fixed for the whole run")
    # nargs="+": Megatron-LM's GPT-3 example passes the schedule unquoted, so it arrives as several words; taking
    # them all lets that script get its refusal with every other reason, not an "unrecognized arguments" alone.
    g.add_argument("--step-batch-size-schedule", nargs="+", default=None, metavar="STEP:SIZE",
                   help="refused: the global batch is fixed")
    _switch(g, "--manual-gc", "Python's garbage collector off, run by hand every --manual-gc-interval iterations "
            "(no collector stalls at random steps on random ranks)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (0: only around evaluation)")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="return cached CUDA memory: 1 after forward/backward and each evaluation batch, 2 also after the "
                        "optimizer step")


def add_data_flags(g: argparse._ArgumentGroup) -> None:
    _switch(g, "--mock-data", "Megatron-LM's deterministic synthetic dataset instead of --data-path (benchmarks, "
            "smoke tests)")
    g.add_argument("--data-cache-path", default=None,
                   help="directory of the sample-index cache (default: beside each dataset)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes per rank (0: read in the training process); same batches")
    _switch(g, "--no-mmap-bin-files", "read the .bin files with file reads instead of a memory map",
            dest="mmap_bin_files", off=True)
    _switch(g, "--no-create-attention-mask-in-dataloader", "accepted: megafp8 never builds an attention mask (the "
            "attention kernel is causal)", dest="create_attention_mask_in_dataloader", off=True)
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: its vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: its merges.txt")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="accepted: read by Megatron-LM's TikTokenizer only, which megafp8 does not offer")


def add_checkpoint_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"), default="torch_dist",
                   help="torch_dist or torch_dcp: megafp8 saves torch.distributed.checkpoint directories with its "
                        "own keys (tools/convert_checkpoint.py writes Megatron-LM's); the others are refused")


def add_logging_flags(g: argparse._ArgumentGroup) -> None:
    _switch(g, "--log-throughput", "accepted: the console line always has tokens/s and TFLOP/s")
    g.add_argument("--wandb-project", default=None,
                   help="log the TensorBoard scalars to this Weights & Biases project too (from the last rank); "
                        "WANDB_MODE=offline works without a network; needs the wandb package")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="the W&B run directory (default: <--save>/wandb)")


def add_implementation_flags(g: argparse._ArgumentGroup) -> None:
    """Flags that pick one of Megatron's implementations of the same math: megafp8 has one of each."""
    g.add_argument("--attention-backend", choices=("flash", "fused", "unfused", "local", "auto"), default="auto",
                   help="accepted: attention runs through PyTorch's scaled_dot_product_attention (flash on GPU)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine", "inference_optimized"),
                   default="transformer_engine", help="accepted: megafp8's layers are its own")
    _switch(g, "--cross-entropy-loss-fusion", "accepted: the vocab-parallel cross entropy is always fused")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native", help="accepted")
    _switch(g, "--use-flash-attn", "accepted: see --attention-backend")
    for flag, dest in (("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                       ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion"), ("--no-rope-fusion", "apply_rope_fusion"),
                       ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion")):
        _switch(g, flag, "accepted: a kernel choice, not the math", dest=dest, off=True)


def fill_megatron_defaults(args: argparse.Namespace) -> None:
    """Megatron-LM's derived values: the MLP, the query groups, the MLP width (validate_args' rules)."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.activation is None and args.swiglu:
        args.activation = "swiglu"
    if args.num_query_groups is None:
        args.num_query_groups = 1 if args.group_query_attention else args.num_attention_heads
    if args.ffn_hidden_size is None and args.activation == "xielu":  # non-gated: Megatron's 4h
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size is None:  # SwiGLU keeps 4h's parameter count, rounded down to a multiple of 64
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64


def megatron_flag_errors(args: argparse.Namespace) -> list[str]:
    """One line per Megatron flag (or Megatron default) megafp8 does not build, with what it supports."""
    errors = []
    if args.normalization != "RMSNorm":
        errors.append(f"--normalization {args.normalization}: megafp8 builds RMSNorm only (Megatron-LM's default is "
                      "LayerNorm, so a Llama script passes --normalization RMSNorm)")
    if args.position_embedding_type != "rope":
        errors.append(f"--position-embedding-type {args.position_embedding_type}: megafp8 uses rotary embeddings only "
                      "(Megatron-LM's default is learned_absolute; pass --position-embedding-type rope)")
    if args.activation is None and not (args.squared_relu or args.openai_gelu):
        errors.append("no --swiglu: Megatron-LM then builds a GeLU MLP, which megafp8 does not; pass --swiglu (or "
                      "--activation swiglu|smooth_swiglu)")
    if args.add_bias_linear:
        errors.append("no --disable-bias-linear: Megatron-LM then adds biases to the linear layers, and megafp8's "
                      "have none; pass --disable-bias-linear")
    for flag, why in REFUSED_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            errors.append(f"{flag}: {why}")
    if args.rotary_percent != 1.0:
        errors.append(f"--rotary-percent {args.rotary_percent}: megafp8 rotates every channel of a head (1.0)")
    if not args.group_query_attention and args.num_query_groups != args.num_attention_heads:
        errors.append(f"--num-query-groups {args.num_query_groups} without --group-query-attention: Megatron-LM "
                      "ignores it and builds multi-head attention; add --group-query-attention")
    if args.kv_channels is not None and args.kv_channels <= 0:
        errors.append(f"--kv-channels must be positive, got {args.kv_channels}")
    for dest in ("attention_dropout", "hidden_dropout"):
        if not 0 <= getattr(args, dest) < 1:
            errors.append(f"--{dest.replace('_', '-')} must be in [0, 1), got {getattr(args, dest)}")
    if args.attention_dropout > 0 and args.context_parallel_size > 1:
        errors.append(f"--attention-dropout {args.attention_dropout} with --context-parallel-size "
                      f"{args.context_parallel_size}: the ring attention has no dropout; pass --attention-dropout 0")
    if args.ckpt_format not in ("torch_dist", "torch_dcp"):
        errors.append(f"--ckpt-format {args.ckpt_format}: megafp8 saves torch.distributed.checkpoint directories "
                      "(torch_dist / torch_dcp); tools/convert_checkpoint.py converts to Megatron-LM's formats")
    errors += _schedule_flag_errors(args) + _system_flag_errors(args)
    return errors


def _schedule_flag_errors(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        errors.append("--decoupled-min-lr needs --decoupled-lr")
    for dest in ("decoupled_lr", "decoupled_min_lr"):
        if getattr(args, dest) is not None and getattr(args, dest) < 0:
            errors.append(f"--{dest.replace('_', '-')} must not be negative, got {getattr(args, dest)}")
    if args.decoupled_lr is not None and args.decoupled_lr >= 0:
        # Their schedule decays from --decoupled-lr down to this floor (megafp8's schedule refuses a rising one).
        floor, flag = ((args.decoupled_min_lr, "--decoupled-min-lr") if args.decoupled_min_lr is not None
                       else (args.min_lr, "--min-lr (the floor without --decoupled-min-lr)"))
        if floor > args.decoupled_lr:
            errors.append(f"{flag} {floor} exceeds --decoupled-lr {args.decoupled_lr}: the embedding and output "
                          "layer's LR decays to it")
    # --lr-warmup-fraction's range is the schedule's rule (megafp8.training.schedules.learning_rate_schedule).
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        errors.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive")
    return errors


def _system_flag_errors(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval must not be negative, got {args.manual_gc_interval}")
    if args.manual_gc_interval and not args.manual_gc:
        errors.append("--manual-gc-interval needs --manual-gc")
    if args.num_workers < 0:
        errors.append(f"--num-workers must not be negative, got {args.num_workers}")
    if args.tokenizer_type == "GPT2BPETokenizer" and (args.vocab_file is None or args.merge_file is None):
        errors.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type != "GPT2BPETokenizer":
        for flag in ("vocab_file", "merge_file"):
            if getattr(args, flag) is not None:
                errors.append(f"--{flag.replace('_', '-')} goes with --tokenizer-type GPT2BPETokenizer")
    if args.mock_data and args.data_path:
        errors.append("--mock-data and --data-path are exclusive")
    if (args.wandb_exp_name or args.wandb_save_dir) and not args.wandb_project:
        errors.append("--wandb-exp-name/--wandb-save-dir need --wandb-project")
    return errors
