"""Benchmark checkpoint save / load of a GPTModel plus Adam-like optimizer state, in one process: wall
time and MB/s of save_checkpoint (DCP write + fsync + SHA-256 + commit), and of load_checkpoint with and
without the SHA-256 verification (sizes are always checked).

    python tools/bench/bench_checkpoint.py                  # ~45M parameters, fp32 weights + 2 moments
    python tools/bench/bench_checkpoint.py --hidden 1024    # bigger

Times are the median of --repeats runs into a fresh directory under --dir (default: a temporary one,
on the file system /tmp lives on; the page cache is not dropped, so reads are mostly from memory).
"""
from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megafp8.checkpoint import load_checkpoint, save_checkpoint, tensor_parallel_state
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState


def _optimizer_state(model: GPTModel, ps: ParallelState) -> dict:
    return {name: {key: tensor_parallel_state(torch.full_like(p, fill), p, 0, 1, model.config.vocab_size)
                   for key, fill in (("exp_avg", 0.5), ("exp_avg_sq", 0.25))}
            for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                         num_attention_heads=8, num_query_groups=8, seq_length=128, vocab_size=args.vocab,
                         make_vocab_size_divisible_by=128)
    ps = ParallelState().init_process_groups()
    model = GPTModel(config, ps)
    optimizer_state = _optimizer_state(model, ps)
    n_params = sum(p.numel() for p in model.parameters())
    megabytes = 3 * n_params * 4 / 2**20
    times: dict[str, list[float]] = {"save": [], "load (verify SHA-256)": [], "load (sizes only)": []}
    for _ in range(args.repeats):
        root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt_"))
        try:
            start = time.perf_counter()
            save_checkpoint(root, 1, model=model, parallel_state=ps, optimizer_state=optimizer_state)
            times["save"].append(time.perf_counter() - start)
            for label, verify in (("load (verify SHA-256)", True), ("load (sizes only)", False)):
                start = time.perf_counter()
                load_checkpoint(root, model=model, parallel_state=ps, optimizer_state=optimizer_state, verify=verify)
                times[label].append(time.perf_counter() - start)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{n_params / 1e6:.1f}M parameters, {megabytes:.0f} MB (fp32 weights + 2 fp32 moments); "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print("| step | median s | MB/s |\n|---|---|---|")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label} | {median:.2f} | {megabytes / median:.0f} |")


if __name__ == "__main__":
    main()
