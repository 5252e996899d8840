"""The block options beyond Llama's (FOG, Qwen3): their flags and checks (docs/training.md "Architectures for FP8")."""
from __future__ import annotations

import argparse


def add_block_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--freeze-qk-layernorm", action="store_true",
                   help="with --qk-layernorm: its gains stay as initialised (1) or loaded, no gradient and no "
                        "optimizer state (FOG's non-trainable QK norm)")
    g.add_argument("--no-pre-norm", dest="pre_norm", action="store_false",
                   help="no RMSNorm in front of attention and the MLP (FOG: with --post-norm and --qk-layernorm)")
    g.add_argument("--post-norm", action="store_true",
                   help="an RMSNorm on each sublayer's output before the residual add, x + RMSNorm(F(x)) (FOG, "
                        "OLMo-2's placement); gains start at 1/sqrt(--num-layers)")
    g.add_argument("--softmax-scale", type=float, default=None,
                   help="attention logits times this instead of 1/sqrt(head dim)")
    g.add_argument("--embedding-scale", type=float, default=1.0,
                   help="the embedding's output times this constant (FOG's input scaling)")


def block_errors(args: argparse.Namespace) -> list[str]:
    """The options' problems, one line each."""
    errors = []
    if args.freeze_qk_layernorm and not args.qk_layernorm:
        errors.append("--freeze-qk-layernorm needs --qk-layernorm")
    for name in ("softmax_scale", "embedding_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    return errors
