"""The per-iteration cost of the result checks (--check-for-nan-in-loss-and-grad, --check-for-spiky-loss, the
--rerun-mode state capture) and of the hang watchdog: ATen ops, device->host reads and host time of a training
iteration that does not log, each configuration against all of them off, through the training entry.

    python tools/bench/bench_result_checks.py                     # a 4-layer fp32 model on CPU, 12 iterations
    python tools/bench/bench_result_checks.py --fp8 --json out.json

Ops are counted with a TorchDispatchMode over the whole iteration (the step, its bookkeeping, the verdict's
resolution); reads are `aten::_local_scalar_dense` and Tensor.tolist/.cpu/.numpy, what makes a GPU host wait. The
host time is the median wall time of the non-logging iterations on this machine (CPU compute included: a difference
of a few percent is within noise here; on a GPU the extra ops are ~20 small launches).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megafp8 import pretrain
from megafp8.training import train as train_module
from megafp8.training.megatron_flags import LLAMA_FLAGS

MODEL = [*LLAMA_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-layers", "4",
         "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--use-distributed-optimizer",
         "--clip-grad", "1.0"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
       "--fp8-amax-compute-algo", "max"]
CONFIGS = {
    "all off": ["--no-check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"],
    "NaN check, no re-run": ["--rerun-mode", "disabled"],
    "NaN check + validate_results (default)": [],
    "+ --check-for-spiky-loss": ["--check-for-spiky-loss"],
    "+ --hang-timeout-minutes 5": ["--check-for-spiky-loss", "--hang-timeout-minutes", "5"],
}


class IterationCounter(TorchDispatchMode):
    """ATen ops and device reads per iteration (the iteration set by the patched train_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.iteration, self.ops, self.reads, self.started = 0, {}, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.iteration] = self.ops.get(self.iteration, 0) + 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads[self.iteration] = self.reads.get(self.iteration, 0) + 1
        return func(*args, **(kwargs or {}))


def measure(flags: list[str], iterations: int, log_interval: int) -> dict:
    counter = IterationCounter()
    original = train_module.Trainer.train_step
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def train_step(trainer):
        counter.iteration = trainer.progress.iteration + 1
        counter.started[counter.iteration] = time.perf_counter()
        return original(trainer)

    def counted(name):
        def read(tensor, *args, **kwargs):
            counter.reads[counter.iteration] = counter.reads.get(counter.iteration, 0) + 1
            return originals[name](tensor, *args, **kwargs)
        return read

    train_module.Trainer.train_step = train_step
    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        with counter:
            status = pretrain.main([*MODEL, *flags, "--train-iters", str(iterations), "--log-interval",
                                    str(log_interval)])
    finally:
        train_module.Trainer.train_step = original
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    if status != 0:
        raise SystemExit(f"the run failed with {status}: {flags}")
    quiet = [i for i in range(3, iterations) if i % log_interval and (i + 1) in counter.started]
    return {"ops": statistics.median(counter.ops.get(i, 0) for i in quiet),
            "reads": max(counter.reads.get(i, 0) for i in quiet),
            "ms": 1e3 * statistics.median(counter.started[i + 1] - counter.started[i] for i in quiet)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="an FP8 delayed-scaling run (the guard on) instead of fp32")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--json", help="also write the rows here")
    options = parser.parse_args(argv)
    rows = []
    for name, flags in CONFIGS.items():
        row = {"config": name, **measure([*(FP8 if options.fp8 else []), *flags], options.iterations,
                                         log_interval=options.iterations)}
        rows.append(row)
    base = rows[0]
    print(f"| configuration ({'FP8 delayed' if options.fp8 else 'fp32'}) | ATen ops / iteration | + vs all off | "
          "device reads / iteration | host ms / iteration (CPU) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['ops']:.0f} | {row['ops'] - base['ops']:+.0f} | {row['reads']} | "
              f"{row['ms']:.1f} |")
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
