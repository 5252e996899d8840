"""Peak saved-activation bytes per pipeline stage: 1F1B vs interleaved 1F1B (with and without recomputation), ZBV, DualPipeV.

    python tools/bench/bench_pipeline_memory.py --pp 4 --output /tmp/pipeline_memory.json

Spawns ``--pp`` gloo processes on CPU (byte counts do not depend on the device), builds each layout with
megafp8.parallel.pipeline.build_pipeline and runs one training step of ``--microbatches`` micro-batches
under megafp8.parallel.pipeline_memory.SavedActivationMeter (bytes autograd keeps for backward, per
storage, parameters excluded). Also measures one micro-batch's saved bytes through all of a rank's
stages (chunks), so the peak reads as "micro-batches in flight". Prints a markdown table (rank 0 gathers every stage's numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from spawn_gloo import run_on_gloo  # beside this script

sys.path.insert(0, os.getcwd())  # run from the checkout's root

VARIANTS = {  # name -> (schedule, virtual-stage layers or None, recompute flags)
    "1f1b": ("1f1b", None, {}),
    "1f1b + selective": ("1f1b", None, dict(recompute_granularity="selective")),
    "1f1b + full (uniform, 1)": ("1f1b", None, dict(recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=1)),
    "interleaved (2 chunks)": ("interleaved", "half", {}),
    "interleaved (2 chunks) + full (uniform, 1)": ("interleaved", "half", dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    "zbv (V, 2 chunks)": ("zbv", None, {}),
    "dualpipev (V, 2 chunks)": ("dualpipev", None, {}),
}


def _one_microbatch(pipe, model_config) -> int:
    """Saved bytes of one micro-batch's forward (and loss) through every local stage of this rank."""
    from megafp8.parallel.pipeline_memory import SavedActivationMeter

    total = 0
    for chunk in pipe.chunks:
        with SavedActivationMeter(pipe.modules) as meter:
            if chunk.pre_process:
                out = chunk(torch.zeros(pipe.micro_batch_size, model_config.seq_length, dtype=torch.long))
            else:
                out = chunk(None, hidden_states=torch.randn(pipe._p2p_shape(), requires_grad=True))
            if chunk.post_process:
                target = torch.zeros(pipe.micro_batch_size, model_config.seq_length, 2, dtype=torch.float64)
                out = pipe.microbatch_loss(out, target)
            total += meter.live_bytes
            del out
    return total


def _measure(rank: int, args: argparse.Namespace) -> dict:
    pp = args.pp
    from megafp8.model import ModelConfig
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.parallel.pipeline import build_pipeline
    from megafp8.parallel.pipeline_memory import SavedActivationMeter

    results = {}
    for name, (schedule, vpp, recompute) in VARIANTS.items():
        cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                          num_attention_heads=args.heads, seq_length=args.seq_length, vocab_size=1000, **recompute)
        vpp_layers = args.num_layers // (2 * pp) if vpp else None
        ps = ParallelState(world_size=pp, pipeline_model_parallel_size=pp, pipeline_schedule=schedule,
                           num_layers_per_virtual_pipeline_stage=vpp_layers).init_process_groups()
        pipe = build_pipeline(cfg, ps, micro_batch_size=args.micro_batch_size, num_microbatches=args.microbatches)
        per_microbatch = _one_microbatch(pipe, cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.micro_batch_size * args.microbatches, cfg.seq_length))
        with SavedActivationMeter(pipe.modules) as meter:
            pipe.step(ids, ids.roll(-1, dims=1))
        gathered = [None] * pp
        dist.all_gather_object(gathered, (meter.peak_bytes, per_microbatch))
        results[name] = gathered
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--output", default=None, help="also write the numbers as JSON here")
    args = parser.parse_args()
    results = run_on_gloo(_measure, args.pp, args)
    print(f"PP={args.pp}, {args.num_layers} layers, h={args.hidden_size}, s={args.seq_length}, "
          f"micro-batch {args.micro_batch_size}, {args.microbatches} micro-batches; peak saved MiB per stage "
          "(micro-batches in flight = peak / one micro-batch's saved bytes on that rank)")
    print("| variant | " + " | ".join(f"rank {r}" for r in range(args.pp)) + " |")
    print("|---|" + "---|" * args.pp)
    for name, per_rank in results.items():
        cells = [f"{peak / 2**20:.2f} ({peak / one:.1f})" for peak, one in per_rank]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
