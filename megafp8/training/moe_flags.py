"""The mixture-of-experts flags (Megatron-LM's names) and the checks that need the rest of the run's flags."""
from __future__ import annotations

import argparse

from megafp8.model.moe_options import (LOAD_BALANCING_TYPES, MOE_FLAG_DEFAULTS, SCORE_FUNCTIONS, TOKEN_DISPATCHERS,
                                       TOKEN_DROP_POLICIES,
                                       moe_errors, parse_moe_layer_freq)


def add_moe_flags(g: argparse._ArgumentGroup) -> None:
    d = MOE_FLAG_DEFAULTS
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (default: a dense model); docs/parallelism.md, 'Mixture of "
                        "experts'")
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=d["moe_layer_freq"],
                   help="which layers are MoE: every N-th (layer i when i %% N == 0; 1 = all) or one 0/1 per layer, "
                        "comma-separated")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's SwiGLU inner width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=d["moe_router_topk"], help="experts per token (k)")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default=d["moe_router_score_function"],
                   help="softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3: the chosen k normalised to sum to 1)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (default: over the k chosen logits)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=d["moe_router_topk_scaling_factor"],
                   help="multiply the k chosen experts' weights by this (DeepSeek-V3's routed scaling factor, 2.5; "
                        "default 1)")
    g.add_argument("--moe-router-dtype", choices=("fp32",), default=None,
                   help="the router's scores are always computed in fp32 (unset or fp32: Megatron's recommendation)")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                   default=d["moe_router_load_balancing_type"],
                   help="aux_loss (Switch: over the micro-batch), seq_aux_loss (DeepSeek-V3: per sequence) or none; "
                        "weighted by --moe-aux-loss-coeff")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=d["moe_aux_loss_coeff"],
                   help="weight of the load-balancing loss (0: logged, not trained on)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="weight of the router z loss, mean logsumexp(logits)^2 (ST-MoE; default none)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="DeepSeek-V3's aux-loss-free balancing: a per-expert bias added to the sigmoid scores for "
                        "the choice, moved once per step towards the mean load")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=d["moe_router_bias_update_rate"],
                   help="with --moe-router-enable-expert-bias: bias += rate x sign(mean load - load) per step")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert (a dense SwiGLU MLP of this width, tensor-parallel) on every token")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert takes at most ceil(tokens x k / experts x this) tokens per micro-batch, the "
                        "rest dropped (default: dropless)")
    g.add_argument("--moe-token-drop-policy", choices=TOKEN_DROP_POLICIES, default=d["moe_token_drop_policy"],
                   help="with a capacity: an expert keeps its highest-weight tokens (probs) or its earliest (position)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: the experts of each MoE layer split over this many ranks of a pipeline stage (Megatron-"
                        "Core's parallel folding: they come from the TP x CP x DP ranks), tokens dispatched by "
                        "all-to-all")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ETP: each expert split over this many ranks of a pipeline stage as the dense MLP over TP "
                        "(its rows all-gathered over them, its outputs reduce-scattered back); default 1 (whole "
                        "experts) with --num-experts")
    g.add_argument("--moe-token-dispatcher-type", choices=TOKEN_DISPATCHERS, default=d["moe_token_dispatcher_type"],
                   help="how tokens reach their experts' ranks under EP: alltoall (each choice's row to its expert's "
                        "rank and back) or allgather (every rank gathers every token and reduce-scatters the sums: "
                        "fixed-size collectives, for small EP); Megatron's flex dispatcher is not built")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="the local experts' linears as grouped GEMMs at ETP 1 with a gated activation: high-precision "
                        "experts through torch._grouped_mm (fp32/bf16 on CPU, bf16 on Hopper; no host read of the "
                        "loads without EP), FP8 experts (tensorwise, delayed, rowwise, blockwise; SwiGLU) through "
                        "megafp8's grouped FP8 GEMMs (fprop, dgrad, wgrad: one kernel each); MX/NVFP4 experts and "
                        "Smooth-SwiGLU run the loop")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="pad every expert's input to its capacity: static shapes, no host read of the loads")


def expert_tensor_parallel_size(args: argparse.Namespace) -> int | None:
    """--expert-tensor-parallel-size, 1 for a MoE model when not given (whole experts, not Megatron's TP size); None
    (the TP size, Megatron's default) for a dense one, whose expert view is then the dense view."""
    if args.expert_tensor_parallel_size is not None:
        return args.expert_tensor_parallel_size
    return 1 if args.num_experts is not None else None


def moe_flag_errors(args: argparse.Namespace) -> list[str]:
    """The MoE options' own problems and what MoE does not compose with yet, one line each."""
    errors = moe_errors(args)
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        for flag, value in (("--expert-model-parallel-size", ep if ep != 1 else None),
                            ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size)):
            if value is not None:
                errors.append(f"{flag} without --num-experts: the model has no experts to split")
        return errors
    if ep >= 1 and args.num_experts % ep:
        errors.append(f"--num-experts ({args.num_experts}) must be divisible by --expert-model-parallel-size ({ep})")
    etp = args.expert_tensor_parallel_size or 1
    expert_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if etp > 1 and expert_ffn is not None and expert_ffn % etp:
        errors.append(f"--moe-ffn-hidden-size ({expert_ffn}) must be divisible by --expert-tensor-parallel-size ({etp})")
    if args.moe_grouped_gemm and (etp > 1 or getattr(args, "activation", None) == "xielu"):
        errors.append("--moe-grouped-gemm with --expert-tensor-parallel-size > 1 or --activation xielu: not built (the "
                      "grouped GEMM runs whole experts with a gated activation; leave it out: the loop runs them)")
    if etp > 1 and getattr(args, "activation", None) == "xielu":
        errors.append("--expert-tensor-parallel-size > 1 with --activation xielu: not built (xIELU's parameters would "
                      "be copies on the ETP ranks whose gradients need a sum over them)")
    for flag, size in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if size > 1 and not args.use_distributed_optimizer:
            errors.append(f"{flag} > 1 needs --use-distributed-optimizer (the ZeRO optimizer shards the experts over "
                          "their expert-data-parallel group)")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        errors.append("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron-Core's "
                      "rule: each TP rank routes its own slice of the sequence)")
    for flag, on, why in (
            ("--enable-cuda-graph", args.enable_cuda_graph, "expert loads change every step (shapes are dynamic)"),
            ("--unit-scaling", args.unit_scaling, "the router and experts are not unit-scaled yet")):
        if on:
            errors.append(f"--num-experts with {flag}: not supported yet ({why})")
    return errors
