"""Model start-up time: seconds for build_pipeline (the training entry's model build: allocate, draw every
parameter from its (seed, name) generator, move to the device) of a ~110M-parameter Llama, one process.

    python tools/bench/bench_startup.py --device cpu --repeats 3

Run from a checkout's root (it imports that checkout's megafp8), so two commits compare by running it in
each. Prints one markdown row: device, parameters, best and median seconds over --repeats builds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())  # run from the checkout's root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--ffn-hidden-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()

    from megafp8.model import ModelConfig
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.parallel.pipeline import build_pipeline

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.hidden_size // 64,
                         num_query_groups=args.hidden_size // 64, seq_length=2048, vocab_size=args.vocab_size)
    ps = ParallelState().init_process_groups()
    seconds, params = [], 0
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        pipeline = build_pipeline(config, ps, micro_batch_size=1, num_microbatches=1, device=args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        params = sum(p.numel() for p in pipeline.parameters())
        del pipeline
    print(f"| {args.device} | {params / 1e6:.1f}M | {min(seconds):.2f} s | {statistics.median(seconds):.2f} s |")


if __name__ == "__main__":
    main()
