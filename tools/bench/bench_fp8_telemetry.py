"""What FP8 telemetry and the saturation guard cost per quantized tensor: aten ops of one Fp8Linear forward +
backward (CPU, reference path) with telemetry off vs on, the ops the reference twin's counting adds inside the
quantize op, one guard check's ops, and the Triton cast's extra bytes (analytic).

    python tools/bench/bench_fp8_telemetry.py [--tokens 256] [--features 256]

Prints the markdown table of docs/benchmarks.md ("FP8 telemetry and the saturation guard").
"""
from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megafp8.fp8 import (Fp8Linear, Fp8Recipe, Fp8ScalingManager, SaturationGuard, enable_fp8_telemetry,
                         invalidate_fp8_weight_caches)
from megafp8_kernels import BLOCK, E4M3, Granularity
from megafp8_kernels.quantize_reference import quantize_reference

RECIPES = {"delayed": Fp8Recipe.delayed, "tensorwise": Fp8Recipe.tensorwise, "rowwise": Fp8Recipe.rowwise,
           "blockwise": Fp8Recipe.blockwise}


class OpCount(TorchDispatchMode):
    """aten ops dispatched (a custom op such as megafp8::quantize counts once) and quantize calls among them."""

    def __init__(self):
        super().__init__()
        self.ops, self.quantizes, self.host_reads = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.quantizes += func is torch.ops.megafp8.quantize.default
        self.host_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _warm_layer(recipe: str, features: int, x: torch.Tensor) -> Fp8Linear:
    torch.manual_seed(0)
    layer = Fp8Linear(features, features, recipe=RECIPES[recipe]())
    layer(x).sum().backward()
    Fp8ScalingManager(layer, None).update()  # a delayed recipe now casts with its history's scale
    return layer


def linear_ops(recipe: str, telemetry: bool, tokens: int = 256, features: int = 256) -> OpCount:
    """Ops of one forward + backward of a warm Fp8Linear (the weight quantized afresh, as each step)."""
    x = torch.randn(tokens, features)
    layer = _warm_layer(recipe, features, x)
    enable_fp8_telemetry(layer, telemetry)
    invalidate_fp8_weight_caches(layer)  # as the optimizer step does: the weight is cast in this step too
    with OpCount() as count:
        layer(x).sum().backward()
    return count


def twin_counting_ops(gran: Granularity, rows: int = 256, cols: int = 256) -> int:
    """Extra aten ops of quantize_reference(stats=True) over stats=False: the CPU twin's counting."""
    x = torch.randn(rows, cols)
    scale = torch.ones(()) if gran is Granularity.TENSORWISE else None
    counts = []
    for stats in (False, True):
        with OpCount() as count:
            quantize_reference(x, E4M3.dtype, gran, scale=scale, stats=stats)
        counts.append(count.ops)
    return counts[1] - counts[0]


def guard_check_ops(layers: int, tokens: int = 64, features: int = 64) -> int:
    """Ops of one guard check between reads (after the first, which builds its device state)."""
    model = torch.nn.Sequential(*[Fp8Linear(features, features, recipe=Fp8Recipe.tensorwise()) for _ in range(layers)])
    enable_fp8_telemetry(model)
    guard = SaturationGuard(read_interval=1 << 30)
    for iteration in (1, 2):
        model(torch.randn(tokens, features)).sum().backward()
        with OpCount() as count:
            guard.check(model, iteration)
    return count.ops


def cast_bytes_per_tile(input_bytes: int, transpose: bool) -> tuple[int, int]:
    """(bytes a 128x128 tile of the Triton cast moves, bytes stats=True adds): the counts are two int64
    atomic adds per tile (16 B), plus one 16 B zeroed counts buffer per tensor."""
    elements = BLOCK * BLOCK
    return elements * (input_bytes + 1 + int(transpose)), 2 * 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--features", type=int, default=256)
    args = parser.parse_args()
    print("| recipe | ops, telemetry off | ops, telemetry on | quantized tensors | extra ops per tensor "
          "| twin's counting ops per tensor (inside megafp8::quantize) |")
    print("|---|---|---|---|---|---|")
    for recipe in RECIPES:
        off, on = (linear_ops(recipe, t, args.tokens, args.features) for t in (False, True))
        gran = RECIPES[recipe]().granularity("input")
        print(f"| {recipe} | {off.ops} | {on.ops} | {on.quantizes} | {(on.ops - off.ops) / on.quantizes:g} "
              f"| {twin_counting_ops(gran)} |")
    print()
    print(f"guard check between reads: {guard_check_ops(2)} ops with 2 layers, {guard_check_ops(12)} with 12, "
          "0 host reads")
    for name, size in (("bf16", 2), ("fp32", 4)):
        for transpose in (False, True):
            moved, extra = cast_bytes_per_tile(size, transpose)
            print(f"Triton cast, {name} input{' + transpose' if transpose else ''}: {moved} B per 128x128 tile, "
                  f"stats add {extra} B ({100 * extra / moved:.3f}%)")


if __name__ == "__main__":
    main()
