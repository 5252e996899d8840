"""Saved activation bytes per rank of a whole GPTModel forward (every layer: norms, GEMMs, attention, MLP, loss)
vs the context-parallel size.

    OMP_NUM_THREADS=1 python tools/bench/bench_context_parallel_model.py --cp 1 2 4 --seq 512

One forward of a small fp32 model (``--layers --hidden --heads --groups --ffn --vocab``, micro-batch 1) over a
``--seq``-token sequence on ``--cp`` spawned gloo ranks, each holding its two load-balanced chunks; the bytes
autograd saves for backward (saved_tensors_hooks, each storage once; parameters excluded) on rank 0, next to
CP=1's divided by CP. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from bench_context_parallel import _saved_bytes_hooks  # beside this script
from spawn_gloo import run_on_gloo

sys.path.insert(0, os.getcwd())  # the checkout being measured (run from its root)


def _measure(rank: int, args) -> dict:
    import torch.distributed as dist

    from megafp8.model import GPTModel, ModelConfig
    from megafp8.parallel.context_parallel import split_for_context_parallel
    from megafp8.parallel.parallel_state import ParallelState

    seq, layers, hidden, heads, groups, ffn, vocab = args
    cp = dist.get_world_size()
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                      num_query_groups=groups, seq_length=seq, vocab_size=vocab, make_vocab_size_divisible_by=128)
    ps = ParallelState(world_size=cp, context_parallel_size=cp).init_process_groups()
    model = GPTModel(cfg, ps)
    ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = (split_for_context_parallel(t, 1, ps.cp_rank, cp) for t in (ids[:, :-1], ids[:, 1:]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, hooks = _saved_bytes_hooks()
    with hooks:
        loss = model(inputs, labels).sum()
    loss.backward()
    return {"local_tokens": inputs.shape[1], "saved_bytes": sum(n for ptr, n in seen.items() if ptr not in params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    rows = {cp: run_on_gloo(_measure, cp, (args.seq, args.layers, args.hidden, args.heads, args.groups, args.ffn,
                                           args.vocab)) for cp in args.cp}
    base = rows[args.cp[0]]["saved_bytes"] * args.cp[0]
    print("| CP | local tokens | saved bytes per rank | x CP=1 | CP=1 / CP |")
    print("|---|---|---|---|---|")
    for cp, row in rows.items():
        print(f"| {cp} | {row['local_tokens']} | {row['saved_bytes']:,} | {row['saved_bytes'] * 1.0 / base:.3f} | "
              f"{base // cp:,} |")


if __name__ == "__main__":
    main()
