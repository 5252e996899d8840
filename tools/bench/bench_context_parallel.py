"""Context-parallel attention per layer vs CP size: saved activation bytes, K/V p2p bytes, and the longest sequence a per-rank memory budget allows.

    python tools/bench/bench_context_parallel.py --cp 1 2 4 --seq 1024 --output /tmp/cp.json
    python tools/bench/bench_context_parallel.py --fp8-attention ...   # the same with --fp8-dot-product-attention

Part 1 (measured, gloo on CPU): one ``context_parallel_attention`` call (forward + backward) of a small
attention (``--batch --heads --kv-heads --head-dim``, ``--dtype``) over a ``--seq``-token sequence on
``--cp`` spawned ranks; the bytes autograd saves for backward (saved_tensors_hooks, each storage once),
the ``cp_kv_p2p`` bytes counted in forward and backward next to their analytic values, and the CPU wall
time of one forward + backward. Part 2 (analytic, using part 1's per-token formula for the attention core):
the longest sequence whose activations fit ``--budget-gib`` per rank for a Llama-like model (``--model-*``,
bf16, TP=1, no recompute), at each CP size; and, measured, the longest power-of-two sequence whose part-1
attention-core saved bytes fit ``--measured-budget-mib`` per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from spawn_gloo import run_on_gloo  # beside this script

sys.path.insert(0, os.getcwd())  # the checkout being measured (run from its root)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_TRANSIENT_COPIES = 3  # fp32 [rows x keys] tensors alive at once in a tile's backward: scores/p, dp, ds


def _saved_bytes_hooks():
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _measure(rank: int, args) -> dict:
    import torch.distributed as dist

    from megafp8.parallel.collectives import CommCounters
    from megafp8.parallel.context_parallel import context_parallel_attention, split_for_context_parallel

    seq, batch, heads, kv_heads, head_dim, dtype_name, reps, comm_type, fp8 = args
    cp, dtype = dist.get_world_size(), _DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(batch, h, seq, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads)]
    q, k, v, dout = (split_for_context_parallel(t, 2, rank, cp).to(dtype) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kwargs = dict(group=dist.group.WORLD, cp_rank=rank, cp_size=cp, comm_type=comm_type,
                  enable_gqa=heads != kv_heads)
    if fp8:  # --fp8-dot-product-attention's operands (hybrid: E4M3 forward, E5M2 gradients); one instance per call
        from megafp8.fp8.dot_product_attention import Fp8AttentionFormats, Fp8Blocks

        blocks = lambda: Fp8Blocks(Fp8AttentionFormats())  # noqa: E731
    else:
        blocks = lambda: None  # noqa: E731
    counters = CommCounters()
    seen, hooks = _saved_bytes_hooks()
    with hooks:
        out = context_parallel_attention(q, k, v, counters=counters, blocks=blocks(), **kwargs)
    forward_bytes = counters["cp_kv_p2p"]
    out.backward(dout)
    backward_bytes = counters["cp_kv_p2p"] - forward_bytes
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        context_parallel_attention(q, k, v, blocks=blocks(), **kwargs).backward(dout)
        times.append(time.perf_counter() - start)
    return {"cp": cp, "comm_type": comm_type, "local_tokens": seq // cp, "saved_bytes": sum(seen.values()),
            "fwd_p2p_bytes": forward_bytes, "bwd_p2p_bytes": backward_bytes,
            "fwd_bwd_ms": 1e3 * statistics.median(times) if times else None}


def analytic_core_saved_bytes(local_tokens, batch, heads, kv_heads, head_dim, elem_size, fp8=False) -> int:
    """q, k, v and the output in the input dtype, plus the fp32 lse per query row (CPU SDPA saves the same at CP=1);
    with FP8 attention q, k and v are saved as FP8 bytes (plus their three fp32 scales) instead."""
    tokens = batch * local_tokens
    qkv_size = 1 if fp8 else elem_size
    return (tokens * head_dim * ((heads + 2 * kv_heads) * qkv_size + heads * elem_size) + tokens * heads * 4
            + (12 if fp8 else 0))


def analytic_p2p_bytes(comm_type, cp, local_tokens, batch, kv_heads, head_dim, elem_size,
                       fp8=False) -> tuple[int, int]:
    """(forward, backward) ``cp_kv_p2p`` bytes per rank per layer (see megafp8/parallel/ring_attention.py); FP8
    attention's K/V messages are FP8 bytes plus K's and V's fp32 scales."""
    if cp == 1:
        return 0, 0
    kv_elems = 2 * batch * kv_heads * local_tokens * head_dim
    kv_message = kv_elems + 8 if fp8 else kv_elems * elem_size
    grad_size = max(elem_size, 4)  # dK/dV accumulate and travel in the fp32 compute dtype
    dkv_hops = cp if comm_type == "p2p" else cp - 1
    return (cp - 1) * kv_message, (cp - 1) * kv_message + dkv_hops * kv_elems * grad_size


def layer_bytes_per_token(hidden, heads, kv_heads, head_dim, ffn, elem_size=2) -> int:
    """Activation bytes one Llama layer saves per token (TP=1, no recompute, bf16 tensors, FP8 copies not counted):
    RMSNorm inputs (2h), QKV / FC1 GEMM inputs (2h), proj input (H d), SwiGLU input (2 f), FC2 input (f), plus
    the attention core (``analytic_core_saved_bytes`` per token)."""
    rest = (4 * hidden + heads * head_dim + 3 * ffn) * elem_size
    return rest + analytic_core_saved_bytes(1, 1, heads, kv_heads, head_dim, elem_size)


def per_rank_bytes(seq, cp, layers, per_token, heads, tile_rows) -> int:
    """Saved activations of all layers for this rank's ``seq / cp`` tokens (micro-batch 1) plus the transient fp32
    scores of one attention tile (``tile_rows`` query rows x the local keys)."""
    local = seq // cp
    return layers * per_token * local + _TRANSIENT_COPIES * 4 * heads * min(tile_rows, local) * local


def longest_sequence(budget, cp, layers, per_token, heads, tile_rows) -> int:
    """The longest multiple of ``2 cp * 128`` tokens whose ``per_rank_bytes`` fit ``budget``."""
    step, seq = 2 * cp * 128, 0
    while per_rank_bytes(seq + step, cp, layers, per_token, heads, tile_rows) <= budget:
        seq += step
    return seq


def measured_longest(cp: int, budget: int, args) -> int:
    """The longest power-of-two sequence whose attention-core saved bytes, measured on ``cp`` gloo ranks, fit
    ``budget``, searched upwards from 256 tokens (0 if 256 do not fit)."""
    seq, best = max(256, 2 * cp), 0
    while seq <= 1 << 16:
        row = run_on_gloo(_measure, cp, (seq, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype, 0, "p2p",
                                         args.fp8_attention))
        if row["saved_bytes"] > budget:
            break
        best, seq = seq, seq * 2
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-types", nargs="+", default=["p2p", "all_gather"], choices=["p2p", "all_gather"])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--measured-budget-mib", type=float, default=4.0,
                        help="per-rank budget of attention-core saved bytes for the measured longest sequence (0: skip)")
    parser.add_argument("--model-hidden", type=int, default=4096)
    parser.add_argument("--model-layers", type=int, default=32)
    parser.add_argument("--model-heads", type=int, default=32)
    parser.add_argument("--model-kv-heads", type=int, default=8)
    parser.add_argument("--model-ffn", type=int, default=14336)
    parser.add_argument("--fp8-attention", action="store_true",
                        help="FP8 dot-product attention (megafp8/fp8/dot_product_attention.py) instead of high precision")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if any(args.seq % (2 * cp) for cp in args.cp):
        parser.error(f"--seq {args.seq} must be divisible by 2 x every --cp value")
    from megafp8.parallel.attention_blocks import Q_TILE_ROWS

    elem = _DTYPES[args.dtype].itemsize
    rows = []
    print("| CP | comm | local tokens | saved bytes (measured / analytic) | p2p fwd bytes (counted / analytic) "
          "| p2p bwd bytes (counted / analytic) | fwd+bwd ms (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for cp in args.cp:
        for comm_type in (args.comm_types if cp > 1 else ["p2p"]):
            row = run_on_gloo(_measure, cp, (args.seq, args.batch, args.heads, args.kv_heads, args.head_dim,
                                             args.dtype, args.reps, comm_type, args.fp8_attention))
            local = row["local_tokens"]
            row["saved_bytes_analytic"] = analytic_core_saved_bytes(local, args.batch, args.heads, args.kv_heads,
                                                                    args.head_dim, elem, args.fp8_attention)
            row["fwd_p2p_analytic"], row["bwd_p2p_analytic"] = analytic_p2p_bytes(
                comm_type, cp, local, args.batch, args.kv_heads, args.head_dim, elem, args.fp8_attention)
            rows.append(row)
            print(f"| {cp} | {comm_type if cp > 1 else 'fp8 block' if args.fp8_attention else 'sdpa'} | {local} | {row['saved_bytes']:,} / "
                  f"{row['saved_bytes_analytic']:,} | {row['fwd_p2p_bytes']:,} / {row['fwd_p2p_analytic']:,} | "
                  f"{row['bwd_p2p_bytes']:,} / {row['bwd_p2p_analytic']:,} | {row['fwd_bwd_ms']:.1f} |")
    per_token = layer_bytes_per_token(args.model_hidden, args.model_heads, args.model_kv_heads,
                                      args.model_hidden // args.model_heads, args.model_ffn)
    budget = int(args.budget_gib * 2**30)
    longest = {cp: longest_sequence(budget, cp, args.model_layers, per_token, args.model_heads, Q_TILE_ROWS)
               for cp in args.cp}
    print(f"\nlongest sequence in {args.budget_gib:g} GiB of activations per rank ({args.model_layers} layers, hidden "
          f"{args.model_hidden}, {per_token:,} saved bytes per token per layer, attention tiles of {Q_TILE_ROWS} rows):")
    print("| CP | longest sequence (tokens) | x CP=1 |")
    print("|---|---|---|")
    base = longest.get(1) or next(iter(longest.values()))
    for cp, seq in longest.items():
        print(f"| {cp} | {seq:,} | {seq / base:.2f} |")
    measured = {}
    if args.measured_budget_mib > 0:
        small_budget = int(args.measured_budget_mib * 2**20)
        measured = {cp: measured_longest(cp, small_budget, args) for cp in args.cp}
        print(f"\nmeasured: longest power-of-two sequence whose attention-core saved bytes fit "
              f"{args.measured_budget_mib:g} MiB per rank (the part 1 attention): "
              + ", ".join(f"CP={cp}: {seq:,}" for cp, seq in measured.items()))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"measured": rows, "per_token_layer_bytes": per_token, "longest_sequence": longest,
                       "measured_longest_sequence": measured}, f, indent=1)


if __name__ == "__main__":
    main()
