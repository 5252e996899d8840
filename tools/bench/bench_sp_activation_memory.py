"""Activation bytes autograd saves for backward, and SP all-gather bytes, under tensor + sequence parallelism, per recipe.

    python tools/bench/bench_sp_activation_memory.py --tp 2 --output /tmp/sp_memory.json

Spawns ``--tp`` gloo processes on CPU (the count does not depend on the device) and counts, with
torch.autograd.graph.saved_tensors_hooks, the bytes of every tensor saved for backward (parameters
excluded) by (1) one ColumnParallelLinear under SP, the layer whose input is all-gathered, and (2) one
whole transformer layer of a small GPT (attention + MLP, BF16 parameters), and the bytes that layer's
forward + backward sends in sequence-parallel all-gathers (``tp_sp_allgather``). It uses only public APIs, so
it runs unchanged on older commits (check one out with ``git worktree add`` and run this file there) to
measure before/after. The rank-0 numbers are printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from spawn_gloo import run_on_gloo  # beside this script

sys.path.insert(0, os.getcwd())  # the checkout being measured (run from its root)

RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise")


class _SavedBytes:
    def __init__(self, module: torch.nn.Module):
        self.param_ptrs = {p.data_ptr() for p in module.parameters()}
        self.nbytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in self.param_ptrs:
            self.nbytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _measure(rank: int, args: argparse.Namespace) -> dict:
    tp = args.tp
    from megafp8.fp8 import Fp8Recipe
    from megafp8.model import GPTModel, ModelConfig
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.parallel.tensor_parallel import ColumnParallelLinear

    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    results = {}
    for name in RECIPES:
        recipe = None if name == "bf16" else getattr(Fp8Recipe, name)()
        ps = ParallelState(world_size=tp, tensor_model_parallel_size=tp, sequence_parallel=True).init_process_groups()
        torch.manual_seed(0)
        column = ColumnParallelLinear(h, 4 * h, ps, fp8_recipe=recipe, params_dtype=torch.bfloat16)
        x = torch.randn(s // tp, b, h, dtype=torch.bfloat16, requires_grad=True)
        with _SavedBytes(column) as column_saved:
            column(x).float().sum().backward()
        cfg = ModelConfig(num_layers=1, hidden_size=h, ffn_hidden_size=args.ffn_hidden_size,
                          num_attention_heads=args.num_attention_heads, num_query_groups=args.num_attention_heads,
                          seq_length=s, vocab_size=128, make_vocab_size_divisible_by=8 * tp)
        cfg.params_dtype = torch.bfloat16
        model = GPTModel(cfg, ps, fp8_recipe=recipe)
        layer = next(iter(model.layers.values()))
        rotary = model.rotary(s)
        ps.comm.reset()
        with _SavedBytes(layer) as layer_saved:
            layer(x, rotary).float().sum().backward()
        results[name] = {"column_parallel_linear": column_saved.nbytes, "transformer_layer": layer_saved.nbytes,
                         "layer_sp_allgather_bytes": ps.comm["tp_sp_allgather"],
                         "layer_sp_allgathers": ps.comm.calls("tp_sp_allgather"),
                         "local_input_bytes_1B": s // tp * b * h}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = run_on_gloo(_measure, args.tp, args)
    print(f"TP={args.tp} + SP, s={args.seq_length} b={args.micro_batch_size} h={args.hidden_size} "
          f"ffn={args.ffn_hidden_size}: bytes saved for backward on one rank")
    for name, row in results.items():
        print(f"  {name:10s} column-parallel linear {row['column_parallel_linear']:>9d}   "
              f"transformer layer {row['transformer_layer']:>10d}   layer SP all-gathers "
              f"{row['layer_sp_allgather_bytes']:>9d} B in {row['layer_sp_allgathers']}   (local input shard at 1 B/elem: "
              f"{row['local_input_bytes_1B']})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
