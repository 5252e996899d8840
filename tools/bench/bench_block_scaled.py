"""Block-scaled quantize and GEMM throughput (MXFP8, MXFP4, NVFP4) on a CUDA GPU, with the BF16 GEMM beside them: native
block-scaled MMAs on Blackwell (sm_100a), "emulated" where tl.dot_scaled upcasts to BF16 (Hopper: a numerics path, no
speedup expected). Prints a markdown table; --json writes the rows. No GPU: exits 1 with one line.

    python tools/bench/bench_block_scaled.py [--size 4096] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("mxfp8", "mxfp4", "nvfp4")


def _cast(recipe: str, x: torch.Tensor, *, transpose: bool = False):
    """A call that quantizes x with `recipe`'s activation layout."""
    from megafp8_kernels.formats import E2M1, E4M3, MX_1X32, NVFP4_1X16
    from megafp8_kernels.microscaling import quantize_microscaled

    fmt, layout = {"mxfp8": (E4M3, MX_1X32), "mxfp4": (E2M1, MX_1X32), "nvfp4": (E2M1, NVFP4_1X16)}[recipe]
    return lambda: quantize_microscaled(x, fmt, layout, transpose=transpose)[0]


def mode(capability: tuple[int, int]) -> str:
    """How the block-scaled GEMM runs on a device of this compute capability."""
    return "native (block-scaled MMA)" if capability[0] >= 10 else "emulated (BF16 upcast)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="M = N = K of the GEMM; the quantize input is (2 size, size)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block_scaled: no CUDA GPU visible; nothing was run", file=sys.stderr)
        return 1
    import triton.testing

    from megafp8_kernels.block_scaled_gemm import block_scaled_gemm_triton

    n = args.size
    capability = torch.cuda.get_device_capability()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    big = torch.randn(2 * n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 2 * n ** 3
    ms = triton.testing.do_bench(lambda: a @ b.t(), warmup=10, rep=50)
    rows = [{"op": "gemm", "recipe": "bf16 (torch)", "mode": "-", "ms": ms, "tflops": flops / ms / 1e9}]
    for recipe in RECIPES:
        qa, qb = _cast(recipe, a)(), _cast(recipe, b)()
        ms = triton.testing.do_bench(lambda: block_scaled_gemm_triton(qa, qb, out_dtype=torch.bfloat16), warmup=10,
                                     rep=50)
        rows.append({"op": "gemm", "recipe": recipe, "mode": mode(capability), "ms": ms, "tflops": flops / ms / 1e9})
        cast = _cast(recipe, big, transpose=True)
        ms = triton.testing.do_bench(cast, warmup=5, rep=30)
        moved = big.numel() * 2 + cast().nbytes  # x read once (each copy reads it: a lower bound) + what is written
        rows.append({"op": "quantize + transposed copy", "recipe": recipe, "mode": "-", "ms": ms,
                     "gbs": moved / ms / 1e6})
    name = torch.cuda.get_device_name()
    print(f"{name} (sm_{capability[0]}{capability[1]}), {n}^3 GEMM, ({2 * n}, {n}) bf16 quantize\n")
    print("| op | recipe | mode | ms | TFLOP/s or GB/s |\n|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else f"{r['gbs']:.0f} GB/s"
        print(f"| {r['op']} | {r['recipe']} | {r['mode']} | {r['ms']:.3f} | {rate} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "capability": capability, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
