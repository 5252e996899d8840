"""--compile, --enable-cuda-graph and --cuda-graph-scope: the flags, their checks, and applying them to this rank's
model chunks (megafp8.model.compile does the compiling)."""
from __future__ import annotations

import argparse

import torch

from megafp8.fp8.recipe import MICROSCALED, SCALING_RULES
from megafp8.model.compile import CUDA_GRAPH_SCOPES, compile_layers
from megafp8.parallel.pipeline_layout import ZERO_BUBBLE_SCHEDULES


def add_compile_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (inductor, torchtitan's unit): norms, RoPE, SwiGLU and "
                        "the FP8 casts fused, one graph per layer shape; the FP8 weight cache and hooks stay eager, "
                        "TP/SP/CP collectives run between graphs (docs/training.md, 'Compile and CUDA graphs')")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="capture each compiled layer's forward and backward in CUDA graphs (inductor's "
                        "mode=reduce-overhead; implies --compile; CUDA GPUs only)")
    g.add_argument("--cuda-graph-scope", choices=CUDA_GRAPH_SCOPES + ("full_iteration",), default=None,
                   help="what --enable-cuda-graph captures: full (each whole transformer layer, the default) or attn "
                        "(each layer's attention only)")


def compile_errors(args: argparse.Namespace) -> list[str]:
    """The compile flags' problems, one line each, before any process group."""
    errors = []
    if args.cuda_graph_scope is not None and not args.enable_cuda_graph:
        errors.append("--cuda-graph-scope needs --enable-cuda-graph")
    if not args.enable_cuda_graph:
        return errors
    if not torch.cuda.is_available():
        errors.append("--enable-cuda-graph needs a CUDA GPU: CUDA graphs replay GPU kernels (on CPU, --compile alone "
                      "removes the per-op Python overhead)")
    if args.cuda_graph_scope == "full_iteration":
        errors.append("--cuda-graph-scope full_iteration: megafp8 captures per layer (full or attn); the step's "
                      "collectives, optimizer and host-side FP8 bookkeeping stay outside the graphs")
    if args.recompute_granularity == "full":
        errors.append("--enable-cuda-graph with --recompute-granularity full: the recompute replays a captured "
                      "forward inside the backward, which CUDA graph trees cannot do safely; use selective recompute")
    return errors


def apply_compile(args: argparse.Namespace, chunks) -> int:
    """Compile this rank's layers as the flags say (nothing without --compile/--enable-cuda-graph); returns how many
    modules were compiled. fullgraph where the FP8 linear op traces (TP = CP = 1, no zero-bubble schedule): a graph
    break is then a bug. Otherwise the op runs eagerly between graphs: its collectives, or under a zero-bubble
    schedule the host-side queue of deferred weight gradients it feeds (megafp8.fp8.deferred_wgrad). FP8 attention
    (--fp8-dot-product-attention) always runs eagerly between graphs: it goes through ring attention, which is
    torch.compiler.disable'd (a graph break at any CP size). MX / NVFP4 casts run eagerly between graphs too
    (megafp8.fp8.microscaling_quantizer: inductor cannot tile their block views)."""
    if not (args.compile or args.enable_cuda_graph):
        return 0
    collectives = args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1
    microscaled = args.fp8_format is not None and SCALING_RULES[args.fp8_recipe].build in MICROSCALED
    deferred_wgrad = args.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
    return compile_layers(chunks, backend="inductor", mode="reduce-overhead" if args.enable_cuda_graph else None,
                          scope=args.cuda_graph_scope or "full",
                          fullgraph=not (collectives or deferred_wgrad or args.fp8_dot_product_attention
                                         or microscaled))
