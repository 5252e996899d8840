"""Expert-parallel dispatch bytes per token, FP8 vs high precision: counted on gloo ranks next to the analytic value.

    python tools/bench/bench_moe_dispatch.py --ep 2 4 --hidden 128 1024 4096 7168 --tokens 512 --output /tmp/moe.json

Each EP size spawns that many gloo ranks on CPU; every rank routes ``--tokens`` tokens to ``--topk`` of ``--experts``
experts uniformly at random and runs one ``ExpertExchange`` dispatch (megafp8/parallel/expert_dispatch.py) in high
precision (fp32 rows, as CPU runs; BF16's bytes are half of them) and in FP8 (E4M3 bytes plus a power-of-two fp32
scale per 1x128 block). Rank 0's ``ep_alltoall`` bytes per dispatched row (a token's copy for one expert on another
rank) are reported next to the analytic ``h + 4 ceil(h/128)`` (FP8) and ``2h`` (BF16), and the FP8/BF16 ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from spawn_gloo import run_on_gloo  # beside this script

sys.path.insert(0, os.getcwd())  # the checkout being measured (run from its root)


def _measure(rank: int, args) -> dict:
    import torch.distributed as dist

    from megafp8.parallel.collectives import GroupHandle
    from megafp8.parallel.expert_dispatch import ExpertExchange
    from megafp8.parallel.parallel_state import ParallelState

    hidden, tokens, experts, topk = args
    ep = dist.get_world_size()
    ps = ParallelState(world_size=ep, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    ps.init_process_groups()
    group: GroupHandle = ps.group("ep")
    generator = torch.Generator().manual_seed(rank)
    choices = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)]).flatten()
    choices = torch.sort(choices).values
    rows = torch.randn(choices.numel(), hidden, generator=generator)
    counts = torch.bincount(choices, minlength=experts)
    result = {}
    for fp8 in (False, True):
        ps.comm.reset()
        exchange = ExpertExchange(counts, group)
        exchange.dispatch(rows, fp8=fp8)
        remote = sum(n for r, n in enumerate(exchange.input_splits) if r != rank)
        result["fp8" if fp8 else "fp32"] = ps.comm.snapshot_and_reset()["ep_alltoall"] / remote
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 1024, 4096, 7168])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--output", help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    rows = []
    print("| EP | h | counted FP8 bytes/row | analytic | counted fp32 bytes/row | BF16 (analytic) | FP8 / BF16 |")
    print("|---|---|---|---|---|---|---|")
    for ep in args.ep:
        for hidden in args.hidden:
            counted = run_on_gloo(_measure, ep, (hidden, args.tokens, args.experts, args.topk))
            fp8_analytic, bf16 = hidden + 4 * -(-hidden // 128), 2 * hidden
            row = dict(ep=ep, hidden=hidden, fp8=counted["fp8"], fp8_analytic=fp8_analytic, fp32=counted["fp32"],
                       bf16=bf16, ratio=counted["fp8"] / bf16)
            rows.append(row)
            print(f"| {ep} | {hidden} | {row['fp8']:.1f} | {fp8_analytic} | {row['fp32']:.1f} | {bf16} | "
                  f"{row['ratio']:.3f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
