"""Benchmark Fp8ScalingManager.update(): device ops dispatched per call and wall time, flat buffers (now)
against the per-state implementation it replaced (loaded from git at BEFORE_FLAT_COMMIT).

    python tools/bench/bench_scaling_update.py                    # 32 and 80 layers, CPU
    python tools/bench/bench_scaling_update.py --device cuda      # on a GPU (times include a synchronize)

A layer holds 4 FP8 linears (QKV, proj, FC1, FC2) x 3 roles (input, weight, grad_output) = 12 states, as
GPTModel does. Every state observes an amax before each update (not timed). Ops are aten ops seen by a
TorchDispatchMode (views and host-to-device copies included); time is the median of --repeats calls.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from megafp8.fp8 import Fp8Recipe, Fp8ScalingManager, ScalingState

BEFORE_FLAT_COMMIT = "7adfd97"  # the last commit with the per-state update (issue 8 item 4)
REPO = Path(__file__).resolve().parents[2]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def load_previous_implementation() -> types.ModuleType | None:
    """megafp8/fp8/scaling_state.py as of BEFORE_FLAT_COMMIT, as a module of the megafp8.fp8 package."""
    try:
        source = subprocess.run(["git", "show", f"{BEFORE_FLAT_COMMIT}:megafp8/fp8/scaling_state.py"], cwd=REPO,
                                check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("megafp8.fp8.scaling_state_before_flat")
    module.__package__ = "megafp8.fp8"
    exec(compile(source, f"{BEFORE_FLAT_COMMIT}:megafp8/fp8/scaling_state.py", "exec"), module.__dict__)
    return module


def gpt_like_states(state_class: type, num_layers: int, recipe: Fp8Recipe, device: str) -> nn.Module:
    def linear() -> nn.Module:
        module = nn.Module()
        module.fp8_scaling = nn.ModuleDict({role: state_class(recipe, recipe.dtype(role))
                                            for role in ("input", "weight", "grad_output")})
        return module

    return nn.ModuleList(nn.ModuleList(linear() for _ in range(4)) for _ in range(num_layers)).to(device)


def measure(manager, states: list, device: str, repeats: int) -> tuple[int, float]:
    generator = torch.Generator().manual_seed(0)
    amaxes = torch.rand(repeats + 2, len(states), generator=generator).to(device)

    def observe(i: int) -> None:
        for state, amax in zip(states, amaxes[i]):
            state.observe(amax)

    for i in range(2):  # warm-up; the new manager builds its flat buffers on the first call
        observe(i)
        manager.update()
    observe(0)
    with OpCounter() as counter:
        manager.update()
    samples = []
    for i in range(repeats):
        observe(i + 2)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        manager.update()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return counter.count, statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 80])
    parser.add_argument("--amax-history-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (1: on a shared 2-core machine more threads only wait on each other)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = Fp8Recipe.delayed(amax_history_len=args.amax_history_len)
    previous = load_previous_implementation()
    if previous is None:
        print(f"(git show {BEFORE_FLAT_COMMIT} failed: only the current implementation is measured)", file=sys.stderr)

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {args.device}, "
          f"{args.threads} thread(s), amax_history_len {args.amax_history_len}, median of {args.repeats}")
    print("| layers | states | implementation | device ops per update() | ms per update() |")
    print("|---|---|---|---|---|")
    for num_layers in args.layers:
        variants = [("flat buffers (now)", ScalingState, lambda m: Fp8ScalingManager(m, None))]
        if previous is not None:
            variants.insert(0, (f"per state ({BEFORE_FLAT_COMMIT})", previous.ScalingState,
                                lambda m: previous.Fp8ScalingManager(m)))
        for name, state_class, make_manager in variants:
            model = gpt_like_states(state_class, num_layers, recipe, args.device)
            states = [m for m in model.modules() if isinstance(m, state_class)]
            ops, ms = measure(make_manager(model), states, args.device, args.repeats)
            print(f"| {num_layers} | {len(states)} | {name} | {ops} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
