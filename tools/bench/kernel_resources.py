"""Registers, spills and shared memory of the compiled Triton kernels (GPU only), read from Triton's kernel objects.

    python tools/bench/kernel_resources.py [--json FILE]

Launches the FP8 GEMM once per launch config (those offered to the autotuner, and the shapes gemm.py
rules out by its register budget, to check that reasoning) x scale mode (tensorwise, blockwise,
blockwise_1x128), checks each result against the reference twin, and prints n_regs / n_spills / shared bytes from the compiled kernel; then runs every
quantize granularity and reports its kernels from Triton's JIT cache. Exits 1 when an offered GEMM
config spills or any result is wrong, 2 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _compiled_kernels(jit_fn):
    """Every compiled variant in a @triton.jit function's cache (Triton 3.x keeps them per device)."""
    for cache in getattr(jit_fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        yield from kernels.values()


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want.double()).pow(2).sum()
    return float(10 * torch.log10(want.double().pow(2).sum() / noise)) if noise > 0 else float("inf")


def _row(kind: str, name: str, kernel) -> dict:
    getattr(kernel, "_init_handles", lambda: None)()  # loads the binary if the launch has not yet; sets n_regs / n_spills
    return {"kind": kind, "name": name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
            "shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
            "num_stages": kernel.metadata.num_stages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_resources: no CUDA GPU visible; nothing to compile", file=sys.stderr)
        return 2

    from megafp8_kernels import E4M3, GemmScaleMode, quantize
    from megafp8_kernels import gemm as G
    from megafp8_kernels import quantize_triton as Q
    from megafp8_kernels.gemm_reference import fp8_gemm_reference

    # Rowwise differs from tensorwise only by two vector loads in the epilogue: the three modes below
    # span the register patterns (epilogue scaling, per-step 128x128 and per-step 1x128 scale loads).
    SURVEY_MODES = (GemmScaleMode.TENSORWISE, GemmScaleMode.BLOCKWISE, GemmScaleMode.BLOCKWISE_1X128)
    hopper = torch.cuda.get_device_capability()[0] == 9
    offered = G.SM90_CONFIGS if hopper else G._FALLBACK_CONFIGS
    rejected = G.SM90_REJECTED_CONFIGS if hopper else []
    default = G.SM90_DEFAULT_CONFIG if hopper else G.FALLBACK_DEFAULT_CONFIG
    M = N = K = 512  # registers do not depend on the problem size; correctness is checked on it too
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    rows, failures = [], []
    print("| kernel | config | mode | n_regs | n_spills | shared KB | SQNR dB |\n|---|---|---|---|---|---|---|")
    for config in offered + rejected:
        c = config.kwargs
        label = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
                 + (" (default)" if config is default else "") + (" (rejected)" if config in rejected else ""))
        for mode in SURVEY_MODES:
            gran_a, gran_b = mode.operand_granularities
            qa, qb = quantize(x, E4M3.dtype, gran_a), quantize(w, E4M3.dtype, gran_b)
            expected = fp8_gemm_reference(qa.data, qb.data, qa.scale_inv, qb.scale_inv)
            try:
                out = torch.full((M, N), float("nan"), device="cuda")  # poisoned: unwritten outputs fail
                _, kernel = G.fp8_gemm_triton(qa.data.cuda(), qb.data.cuda(), qa.scale_inv.cuda(),
                                              qb.scale_inv.cuda(), out=out, config=config)
                torch.cuda.synchronize()
            except Exception as err:  # e.g. out of shared memory: report, do not stop the survey
                print(f"| gemm | {label} | {mode.value} | failed: {str(err).splitlines()[0][:80]} | | | |")
                if config not in rejected:
                    failures.append(f"{label} {mode.value}: {err}")
                continue
            row = _row("gemm", f"{label} {mode.value}", kernel)
            row["sqnr_db"] = _sqnr_db(out.cpu(), expected)
            rows.append(row)
            print(f"| gemm | {label} | {mode.value} | {row['n_regs']} | {row['n_spills']} | "
                  f"{row['shared_bytes'] / 1024:.0f} | {row['sqnr_db']:.1f} |")
            if config not in rejected and row["n_spills"]:
                failures.append(f"{label} {mode.value}: {row['n_spills']} spilled registers")
            if not row["sqnr_db"] >= 50.0:
                failures.append(f"{label} {mode.value}: SQNR {row['sqnr_db']:.1f} dB against the twin")

    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for gran in ("tensorwise", "rowwise", "block_1x128", "block_128x128"):
        quantize(xb, E4M3.dtype, gran, transpose=True)
        quantize(xb, E4M3.dtype, gran)
    quantize(xb, E4M3.dtype, scale=torch.ones((), device="cuda"), transpose=True)
    for jit_fn in (Q._tile_amax_kernel, Q._cast_tile_kernel):
        for i, kernel in enumerate(_compiled_kernels(jit_fn)):
            row = _row("quantize", f"{jit_fn.fn.__name__} variant {i}", kernel)
            rows.append(row)
            print(f"| quantize | {row['name']} | | {row['n_regs']} | {row['n_spills']} | "
                  f"{row['shared_bytes'] / 1024:.0f} | |")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "failures": failures}, f, indent=1)
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
