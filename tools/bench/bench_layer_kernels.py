"""Kernel launches per transformer layer (forward + backward), per FP8 recipe, with and without the fused
RMSNorm -> FP8 and SwiGLU -> FP8 prologues; also the bytes autograd saves for backward.

    python tools/bench/bench_layer_kernels.py [--telemetry] [--json out.json]
    python tools/bench/bench_layer_kernels.py --tp 2 --sequence-parallel   # rank 0 of 2 gloo processes

Counts, with a TorchDispatchMode on CPU, every aten op and megafp8 custom op one TransformerLayer dispatches
in a training micro-batch (forward, then backward); view ops (no data moved, no launch on a GPU) are left out
and listed apart. Each counted op is one kernel launch on a GPU (a megafp8 custom op is one Triton launch,
except the tensorwise/rowwise current-scaling quantizers, which run an amax pass first). The micro-batch is
the first of a step (after Fp8ScalingManager.update(), so delayed states are warm, and after the weight caches
were invalidated, so the weight casts are included). The counts do not depend on the sizes. Saved bytes: every
tensor autograd keeps for backward, parameters excluded. --telemetry counts with FP8 telemetry on, as every step of
a default FP8 run (the saturation guard turns it on): the casts then also count saturated/flushed elements.
--tp N [--sequence-parallel] counts rank 0's layer of a TP group of N gloo processes (CPU): collectives are counted
as ops too (c10d::*, one launch each); its sizes (hidden 128, seq 64 x N, batch 2) give each rank 128 token rows
under SP, a multiple of 128, as the fused 1x128 prologue under SP needs (linear_function._fuses_sequence_shard).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from bench_sp_activation_memory import _SavedBytes  # beside this script: bytes saved for backward, params excluded
from spawn_gloo import run_on_gloo  # beside this script
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.getcwd())  # the checkout being measured (run from its root)

from megafp8.fp8 import (  # noqa: E402
    Fp8Recipe,
    Fp8ScalingManager,
    enable_fp8_telemetry,
    fp8_autocast,
    invalidate_fp8_weight_caches,
)
from megafp8.model.config import ModelConfig  # noqa: E402
from megafp8.model.model import GPTModel  # noqa: E402
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager  # noqa: E402
from megafp8.parallel.parallel_state import ParallelState  # noqa: E402

RECIPES = {
    "high precision": None,
    "delayed": Fp8Recipe.delayed(amax_history_len=16),
    "tensorwise": Fp8Recipe.tensorwise(),
    "rowwise": Fp8Recipe.rowwise(),
    "blockwise": Fp8Recipe.blockwise(),
    "delayed + smooth_swiglu": Fp8Recipe.delayed(amax_history_len=16),
}


class LaunchCount(TorchDispatchMode):
    """Ops dispatched inside, by name; views (aliasing outputs, no kernel) counted apart."""

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.launches)[func.name()] += 1
        return func(*args, **(kwargs or {}))


def count_layer(recipe_name: str, fused: bool, hidden: int = 128, seq: int = 32, batch: int = 2,
                telemetry: bool = False, tp: int = 1, sequence_parallel: bool = False) -> dict:
    """Launches of one TransformerLayer's forward and backward (see the module docstring). tp > 1: this rank's
    layer of a TP group (call it on every rank of an initialised process group, as main does via spawn_gloo)."""
    recipe = RECIPES[recipe_name]
    activation = "smooth_swiglu" if "smooth_swiglu" in recipe_name else "swiglu"
    cfg = ModelConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=4,
                      num_query_groups=2, seq_length=seq, activation=activation)
    torch.manual_seed(0)
    ps = ParallelState(world_size=tp, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    model = GPTModel(cfg, ps.init_process_groups())
    layer, rotary = model.layers["0"], model.rotary(seq)
    layer.fuse_fp8_prologues = fused
    enable_fp8_telemetry(layer, telemetry)
    manager = fp8_scaling_manager(layer, ps) if tp > 1 else Fp8ScalingManager(layer, None)
    local_seq = seq // tp if sequence_parallel else seq

    def micro_batch(forward_mode=None, backward_mode=None, saved=None):
        x = torch.randn(local_seq, batch, hidden, requires_grad=True)
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            with forward_mode or _Nothing(), saved or _Nothing():
                y = layer(x, rotary)
        grad = torch.ones_like(y)
        with backward_mode or _Nothing():
            y.backward(grad)

    micro_batch()  # warm-up step: delayed histories filled, then a new step begins
    manager.update()
    invalidate_fp8_weight_caches(layer)
    layer.zero_grad(set_to_none=True)
    forward, backward, saved = LaunchCount(), LaunchCount(), _SavedBytes(layer)
    micro_batch(forward, backward, saved)
    return {"recipe": recipe_name, "fused": fused, "telemetry": telemetry, "tp": tp,
            "sequence_parallel": sequence_parallel, "forward": sum(forward.launches.values()),
            "backward": sum(backward.launches.values()), "views": sum(forward.views.values()) + sum(backward.views.values()),
            "saved_bytes": saved.nbytes, "forward_ops": dict(forward.launches), "backward_ops": dict(backward.launches)}


def _count_rows(rank: int, args: argparse.Namespace) -> list[dict]:
    kw = dict(telemetry=args.telemetry, tp=args.tp, sequence_parallel=args.sequence_parallel)
    if args.tp > 1:
        kw["seq"] = 64 * args.tp  # 128 token rows per rank under SP: see the module docstring
    return [count_layer(name, fused, **kw) for name in RECIPES for fused in (False, True)]


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows (with per-op counts) here")
    parser.add_argument("--telemetry", action="store_true", help="FP8 telemetry on, as the default saturation guard")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (gloo processes on CPU; rank 0 counted)")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1: sequence parallelism")
    args = parser.parse_args(argv)
    rows = run_on_gloo(_count_rows, args.tp, args) if args.tp > 1 else _count_rows(0, args)
    if args.tp > 1:
        print(f"TP={args.tp}{' + SP' if args.sequence_parallel else ''}, rank 0:")
    print("| recipe | unfused fwd + bwd = total | fused fwd + bwd = total | saved bytes unfused -> fused |")
    print("|---|---|---|---|")
    for before, after in zip(rows[::2], rows[1::2]):
        cells = [f"{r['forward']} + {r['backward']} = {r['forward'] + r['backward']}" for r in (before, after)]
        print(f"| {before['recipe']} | {cells[0]} | {cells[1]} | {before['saved_bytes']:,} -> {after['saved_bytes']:,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
