"""The block options beyond Llama's (FOG, Qwen3): their flags and checks (docs/training.md "Architectures for FP8")."""
from __future__ import annotations

import argparse

from megafp8.fp8.recipe import is_power_of_two


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
    g.add_argument("--unit-scaling", action="store_true",
                   help="μnit Scaling's unit-scaled model: every weight initialised N(0, 1) and each linear's output "
                        "times the fixed 1/sqrt(fan_in), so activations stay near unit scale (for --fp8-recipe static)")
    g.add_argument("--residual-tau", type=float, default=None,
                   help="variance-preserving residual adds, sqrt(1 - tau) x + sqrt(tau) F(x) (μnit Scaling; "
                        "with --post-norm its gains start at 1)")
    g.add_argument("--allow-static-fp8-without-unit-scaling", action="store_true",
                   help="--fp8-recipe static on a model without --unit-scaling (its activations are far from unit "
                        "scale: expect saturated and flushed casts)")


def block_errors(args: argparse.Namespace, given: set[str]) -> list[str]:
    """The options' problems, one line each (`given`: the flags on the command line)."""
    errors = []
    if args.freeze_qk_layernorm and not args.qk_layernorm:
        errors.append("--freeze-qk-layernorm needs --qk-layernorm")
    if args.residual_tau is not None and not 0 < args.residual_tau < 1:
        errors.append(f"--residual-tau must be in (0, 1), got {args.residual_tau}")
    if args.unit_scaling and "--init-method-std" in given:
        errors.append("--init-method-std with --unit-scaling: a unit-scaled model initialises every weight N(0, 1)")
    static = args.fp8_format is not None and args.fp8_recipe == "static"
    if static and not args.unit_scaling and not args.allow_static_fp8_without_unit_scaling:
        errors.append("--fp8-recipe static needs a unit-scaled model (--unit-scaling): its fixed scales assume "
                      "activations, weights and gradients near unit scale, and a standard Llama's overflow or flush "
                      "(--allow-static-fp8-without-unit-scaling to run it anyway)")
    if "--fp8-static-grad-scale" in given and not static:
        errors.append("--fp8-static-grad-scale needs --fp8-format and --fp8-recipe static")
    if not is_power_of_two(args.fp8_static_grad_scale):
        errors.append(f"--fp8-static-grad-scale must be a power of two (exact to invert), got "
                      f"{args.fp8_static_grad_scale}")
    if args.fp8_dot_product_attention:
        if args.fp8_format is None:
            errors.append("--fp8-dot-product-attention needs --fp8-format")
        if args.fp4 is not None:
            errors.append("--fp8-dot-product-attention with --fp4-format: FP4 layers keep attention in high precision "
                          "(there is no FP4 attention)")
        if args.attention_dropout:
            errors.append("--fp8-dot-product-attention does not drop attention probabilities: set --attention-dropout 0")
    for name in ("softmax_scale", "embedding_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    return errors
