"""The microscaling and FP4 flags (Megatron-LM's --fp4-format / --fp4-recipe / --fp4-param-gather, and megafp8's
ablation switches), how they select the run's recipe, and their checks."""
from __future__ import annotations

import argparse
import math

from megafp8.fp8.precision_schedule import GEMM_SCOPES, PrecisionSchedule
from megafp8.fp8.recipe import FP4_SCALINGS, MICROSCALED, SCALING_RULES, Fp8Recipe
from megafp8_kernels.microscaling_reference import HADAMARD_SIZE

FP4_FORMATS = ("e2m1",)
SWITCH_TARGETS = ("bf16", "mxfp8", "tensorwise", "rowwise", "blockwise")
GRAD_NOISE_THRESHOLD = math.sqrt(3.0)  # "FP4 All the Way": half the range of a uniform noise of that sigma


def add_microscaling_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--fp4-format", dest="fp4", choices=FP4_FORMATS, default=None,
                   help="turns FP4 GEMMs on (E2M1 elements; with --fp4-recipe): every linear layer's three GEMMs in "
                        "FP4 (docs/training.md 'Microscaling and FP4')")
    g.add_argument("--fp4-recipe", choices=FP4_SCALINGS, default="nvfp4",
                   help="nvfp4 (E4M3 scale per 16 under an fp32 tensor scale, 16x16 weight tiles, stochastic rounding "
                        "of gradients, Hadamard transform on the wgrad operands) or mxfp4 (E8M0 scale per 32)")
    g.add_argument("--fp4-param-gather", action="store_true",
                   help="nvfp4: the distributed optimizer casts each owned shard of an FP4 layer's weight straight to "
                        "NVFP4 and all-gathers packed E2M1 bytes (two per byte) instead of high-precision values: "
                        "0.27x BF16's bytes with the tile amaxes' MAX all-reduce (needs --use-distributed-optimizer)"),
    g.add_argument("--mx-scale-rounding", choices=("ceil", "floor"), default="ceil",
                   help="mxfp8/mxfp4 block scales: ceil (RCEIL, as TransformerEngine and cuBLAS: a block's maximum "
                        "never saturates) or floor (the OCP spec's rule, for comparison)")
    g.add_argument("--fp4-no-stochastic-rounding", action="store_true",
                   help="FP4 recipes: round gradients to nearest instead of stochastically (ablation)")
    g.add_argument("--fp4-no-hadamard", action="store_true",
                   help="FP4 recipes: no random Hadamard transform on the wgrad operands (ablation)")
    g.add_argument("--fp4-no-2d-weights", action="store_true",
                   help="nvfp4: quantize weights in 1x16 blocks (each GEMM its own copy) instead of 16x16 tiles "
                        "(ablation)")
    g.add_argument("--fp4-guard-fallback", choices=SWITCH_TARGETS, default="mxfp8",
                   help="where the saturation guard moves a saturating FP4 layer first (then to BF16 if it still "
                        "saturates): an FP8 recipe, or bf16 to skip the FP8 step")
    g.add_argument("--fp4-until-iteration", type=int, default=None,
                   help="precision schedule: the last iteration in FP4; from the next one the FP4 layers run "
                        "--fp4-switch-to (the FP4 papers' late switch to higher precision)")
    g.add_argument("--fp4-until-fraction", type=float, default=None,
                   help="the same as a fraction of the run's iterations (e.g. 0.82: the last 18%% in higher precision)")
    g.add_argument("--fp4-until-grad-noise", action="store_true",
                   help="precision schedule fired by the FP4 All the Way paper's rule: switch once the FP4 layers' weight "
                        "gradients' norm falls below --fp4-grad-noise-threshold x the FP4 wgrad's quantization noise, "
                        "measured every --fp4-grad-noise-interval iterations (not with --sequence-parallel)")
    g.add_argument("--fp4-grad-noise-interval", type=int, default=None,
                   help="iterations between grad-noise probes (default: --log-interval); a probe step also runs each "
                        "FP4 wgrad in fp32 and all-reduces two weight-sized buffers")
    g.add_argument("--fp4-grad-noise-threshold", type=float, default=GRAD_NOISE_THRESHOLD,
                   help="the switch fires at the first probe whose gradient-norm / quantization-noise ratio is below "
                        "this (the paper's sqrt(3))")
    g.add_argument("--fp4-switch-to", choices=SWITCH_TARGETS, default="bf16",
                   help="what the FP4 layers run after the switch: bf16 (high precision) or an FP8 recipe (with "
                        "--fp8-format's elements, e4m3 by default)")
    g.add_argument("--fp4-switch-gemms", choices=GEMM_SCOPES, default="all",
                   help="all GEMMs switch, or only fprop (the NVFP4 paper's variant: the forward GEMMs in high "
                        "precision, dgrad and wgrad stay FP4; not with --sequence-parallel)")


def fill_microscaling_defaults(args: argparse.Namespace) -> None:
    """--fp4-format selects the FP4 recipe as the run's recipe (the FP8 element format stays for the FP8 parts)."""
    if args.fp4 is not None:
        args.fp8_recipe = args.fp4_recipe
        if args.fp8_format is None:
            args.fp8_format = SCALING_RULES[args.fp4_recipe].default_format


def microscaling_errors(args: argparse.Namespace, given: set[str]) -> list[str]:
    """The flags' problems, one line each, before any process group. `given`: the flags on the command line."""
    errors = []
    if args.fp4 is None:
        for flag in ("--fp4-recipe", "--fp4-no-stochastic-rounding", "--fp4-no-hadamard", "--fp4-no-2d-weights",
                     "--fp4-guard-fallback"):
            if flag in given:
                errors.append(f"{flag} needs --fp4-format e2m1")
    elif "--fp8-recipe" in given:
        errors.append("--fp8-recipe with --fp4-format: the run's recipe is --fp4-recipe's (layers kept out of FP4 run "
                      "in BF16, --first-last-layers-bf16)")
    errors += _param_gather_errors(args)
    microscaled = args.fp8_format is not None and SCALING_RULES[args.fp8_recipe].build in MICROSCALED
    if "--mx-scale-rounding" in given and not (microscaled and args.fp8_recipe in ("mxfp8", "mxfp4")):
        errors.append("--mx-scale-rounding needs --fp8-recipe mxfp8 or --fp4-format e2m1 --fp4-recipe mxfp4")
    scheduled = is_scheduled(args)
    errors += _grad_noise_errors(args, given)
    if args.fp4_until_iteration is not None and args.fp4_until_fraction is not None:
        errors.append("--fp4-until-iteration and --fp4-until-fraction are exclusive")
    if scheduled and args.fp4 is None:
        errors.append("--fp4-until-iteration/--fp4-until-fraction need --fp4-format e2m1")
    if args.fp4_until_fraction is not None and not 0 < args.fp4_until_fraction < 1:
        errors.append(f"--fp4-until-fraction must be in (0, 1), got {args.fp4_until_fraction}")
    if args.fp4_until_iteration is not None and args.fp4_until_iteration < 0:
        errors.append(f"--fp4-until-iteration must be >= 0, got {args.fp4_until_iteration}")
    for flag in ("--fp4-switch-to", "--fp4-switch-gemms"):
        if flag in given and not scheduled:
            errors.append(f"{flag} needs --fp4-until-iteration, --fp4-until-fraction or --fp4-until-grad-noise")
    if scheduled and args.fp4_switch_gemms == "fprop" and args.sequence_parallel:
        errors.append("--fp4-switch-gemms fprop with --sequence-parallel: the high-precision forward would gather x "
                      "in high precision, which is not built (switch all GEMMs, or leave out --sequence-parallel)")
    if scheduled and args.fp4_switch_gemms == "fprop" and _expert_tensor_parallel(args):
        errors.append("--fp4-switch-gemms fprop with --expert-tensor-parallel-size > 1: an expert's linears gather "
                      "their rows as sequence parallelism does, and the high-precision gather is not built")
    if args.fp4 is not None and not args.fp4_no_hadamard:
        tokens = args.micro_batch_size * args.seq_length // max(args.context_parallel_size, 1)
        if tokens % HADAMARD_SIZE:
            errors.append(f"--fp4-format: the Hadamard transform runs along the tokens of a micro-batch in blocks of "
                          f"{HADAMARD_SIZE}; --micro-batch-size x --seq-length (/ --context-parallel-size) = {tokens} "
                          "is not a multiple (or pass --fp4-no-hadamard)")
    return errors


def is_scheduled(args: argparse.Namespace) -> bool:
    """Whether the run has a precision schedule (an iteration, a fraction or the grad-noise trigger)."""
    return (args.fp4_until_iteration is not None or args.fp4_until_fraction is not None
            or args.fp4_until_grad_noise)


def _expert_tensor_parallel(args: argparse.Namespace) -> bool:
    """Experts split over ETP: their linears run the sequence-parallel path (megafp8.model.moe)."""
    return (getattr(args, "expert_tensor_parallel_size", None) or 1) > 1


def _grad_noise_errors(args: argparse.Namespace, given: set[str]) -> list[str]:
    errors = []
    for flag in ("--fp4-grad-noise-interval", "--fp4-grad-noise-threshold"):
        if flag in given and not args.fp4_until_grad_noise:
            errors.append(f"{flag} needs --fp4-until-grad-noise")
    if not args.fp4_until_grad_noise:
        return errors
    if args.fp4 is None:
        errors.append("--fp4-until-grad-noise needs --fp4-format e2m1")
    if args.sequence_parallel:
        errors.append("--fp4-until-grad-noise with --sequence-parallel: the probe's exact wgrad needs the gathered "
                      "high-precision input, which is not built (leave out --sequence-parallel)")
    if getattr(args, "expert_model_parallel_size", 1) > 1 or _expert_tensor_parallel(args):
        errors.append("--fp4-until-grad-noise with --expert-model-parallel-size or --expert-tensor-parallel-size > 1: "
                      "the experts' probe buffers would reduce over the expert-data-parallel group (and gather over "
                      "ETP as under --sequence-parallel), which is not built")
    if args.fp4_grad_noise_interval is not None and args.fp4_grad_noise_interval < 1:
        errors.append(f"--fp4-grad-noise-interval must be >= 1, got {args.fp4_grad_noise_interval}")
    if not args.fp4_grad_noise_threshold > 0:
        errors.append(f"--fp4-grad-noise-threshold must be > 0, got {args.fp4_grad_noise_threshold}")
    return errors


def _param_gather_errors(args: argparse.Namespace) -> list[str]:
    """--fp4-param-gather gathers NVFP4's 16x16 weight tiles; an MX weight's two copies are each quantized from high
    precision (1x32 groups along different axes), so gathering them would cost more bytes than BF16."""
    errors = []
    if args.fp4_param_gather:
        if args.fp4 is None or args.fp4_recipe != "nvfp4":
            errors.append("--fp4-param-gather needs --fp4-format e2m1 --fp4-recipe nvfp4 (an MX weight's row-wise and "
                          "column-wise copies are each quantized from high precision: gathering both as bytes would "
                          "cost 2 x 0.53 bytes per element plus amaxes, so MXFP4 weights are gathered in high "
                          "precision)")
        elif args.fp4_no_2d_weights:
            errors.append("--fp4-param-gather with --fp4-no-2d-weights: 1x16 weights need a second copy quantized from "
                          "high precision for dgrad; the gather carries the 16x16 tiles that serve both GEMMs")
        if not args.use_distributed_optimizer:
            errors.append("--fp4-param-gather needs --use-distributed-optimizer (the owner of each shard casts it)")
        if is_scheduled(args):
            if args.fp4_switch_gemms == "fprop":
                errors.append("--fp4-param-gather with --fp4-switch-gemms fprop: after the switch the forward needs "
                              "the high-precision weight and dgrad the FP4 one; switch all GEMMs")
    if args.fp8_param_gather and args.fp4 is not None:
        errors.append("--fp8-param-gather with --fp4-format: FP4 weights are gathered with --fp4-param-gather "
                      "(Megatron-LM's flag)")
    elif args.fp8_param_gather and args.fp8_format is not None and args.fp8_recipe == "mxfp8":
        errors.append("--fp8-param-gather with the mxfp8 recipe: an MXFP8 weight's 1x32 copy and its transposed copy "
                      "are each quantized from high precision, so gathering both as bytes (2.06 bytes per element) "
                      "costs more than BF16's 2; leave it out: the weights are gathered in high precision, as "
                      "Megatron-Core does for MXFP8")
    return errors


def precision_schedule_from_args(args: argparse.Namespace, train_iters: int) -> PrecisionSchedule | None:
    """The run's precision schedule (None without --fp4-until-*): the switch's first iteration and its target. With
    --fp4-until-grad-noise alone it is past the run's end until the trigger fires (grad_noise_trigger.py)."""
    if args.fp4 is None or not is_scheduled(args):
        return None
    last_fp4 = (args.fp4_until_iteration if args.fp4_until_iteration is not None
                else round(args.fp4_until_fraction * train_iters) if args.fp4_until_fraction is not None
                else train_iters)
    then = None
    if args.fp4_switch_to != "bf16":
        then = Fp8Recipe.named(args.fp4_switch_to, fp8_format=args.fp8_format or "e4m3",
                               mx_scale_rounding=args.mx_scale_rounding)
    return PrecisionSchedule(at=last_fp4 + 1, then=then, gemms=args.fp4_switch_gemms)
