"""Registers, spills and shared memory of the compiled Triton kernels (GPU only), read from Triton's kernel objects.

    python tools/bench/kernel_resources.py [--json FILE]

Launches the FP8 GEMM once per launch config (those offered to the autotuner, and the shapes gemm.py
rules out by its register budget, to check that reasoning) x scale mode (tensorwise, blockwise,
blockwise_1x128) x training GEMM (fprop E4M3 x E4M3; dgrad E5M2 x E4M3 to bf16; wgrad E5M2 x E4M3 accumulated
into an fp32 C, as into main_grad), checks each result against the reference twin, and prints n_regs / n_spills /
shared bytes from the compiled kernel; then runs every quantize granularity (E4M3 and E5M2, with stats) and the
fused RMSNorm/SwiGLU casts, and reports their kernels from Triton's JIT cache. Exits 1 when an offered GEMM
config spills or any result is wrong, 2 without a CUDA GPU. Uses only Triton APIs that 3.6 (the GPU image's) and
3.9 share; tools/bench/kernel_audit.py checks the same kernels offline under both, without a GPU.
"""
from __future__ import annotations

import argparse
import itertools
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

    from megafp8_kernels import E4M3, E5M2, GemmScaleMode, quantize, rmsnorm_quantize, swiglu_quantize
    from megafp8_kernels import gemm as G
    from megafp8_kernels import norm_quantize_triton as NQ
    from megafp8_kernels import quantize_triton as Q
    from megafp8_kernels.gemm_reference import fp8_gemm_reference

    # Rowwise differs from tensorwise only by two vector loads in the epilogue: the three modes below
    # span the register patterns (epilogue scaling, per-step 128x128 and per-step 1x128 scale loads).
    SURVEY_MODES = (GemmScaleMode.TENSORWISE, GemmScaleMode.BLOCKWISE, GemmScaleMode.BLOCKWISE_1X128)
    # (GEMM, A's format, C's dtype, accumulate into C): what linear_function.py runs, hybrid format (E5M2 gradients).
    TRAINING_GEMMS = (("fprop", "e4m3", torch.float32, False), ("dgrad", "e5m2", torch.bfloat16, False),
                      ("wgrad", "e5m2", torch.float32, True))
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
        for mode, (gemm, a_format, out_dtype, accumulate) in itertools.product(SURVEY_MODES, TRAINING_GEMMS):
            gran_a, gran_b = mode.operand_granularities
            a_dtype = (E5M2 if a_format == "e5m2" else E4M3).dtype
            qa, qb = quantize(x, a_dtype, gran_a), quantize(w, E4M3.dtype, gran_b)
            # wgrad adds into what C holds (main_grad); the others write a NaN-poisoned C: unwritten outputs fail.
            c0 = torch.randn(M, N, generator=g) if accumulate else torch.full((M, N), float("nan"))
            expected = fp8_gemm_reference(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=out_dtype,
                                          out=c0.clone().to(out_dtype), accumulate=accumulate).float()
            what = f"{mode.value} {gemm}"
            try:
                out = c0.to(out_dtype).cuda()
                _, kernel = G.fp8_gemm_triton(qa.data.cuda(), qb.data.cuda(), qa.scale_inv.cuda(),
                                              qb.scale_inv.cuda(), out_dtype=out_dtype, out=out,
                                              accumulate=accumulate, config=config)
                torch.cuda.synchronize()
            except Exception as err:  # e.g. out of shared memory: report, do not stop the survey
                print(f"| gemm | {label} | {what} | failed: {str(err).splitlines()[0][:80]} | | | |")
                if config not in rejected:
                    failures.append(f"{label} {what}: {err}")
                continue
            row = _row("gemm", f"{label} {what}", kernel)
            row["sqnr_db"] = _sqnr_db(out.float().cpu(), expected)
            rows.append(row)
            print(f"| gemm | {label} | {what} | {row['n_regs']} | {row['n_spills']} | "
                  f"{row['shared_bytes'] / 1024:.0f} | {row['sqnr_db']:.1f} |")
            if config not in rejected and row["n_spills"]:
                failures.append(f"{label} {what}: {row['n_spills']} spilled registers")
            # bf16 outputs round to 8 bits of mantissa (~48 dB): the bar is the output's precision, not the GEMM's.
            if not row["sqnr_db"] >= (40.0 if out_dtype == torch.bfloat16 else 50.0):
                failures.append(f"{label} {what}: SQNR {row['sqnr_db']:.1f} dB against the twin")

    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    for fmt, transpose, stats in itertools.product((E4M3, E5M2), (False, True), (False, True)):
        for gran in ("tensorwise", "rowwise", "block_1x128", "block_128x128"):
            quantize(xb, fmt.dtype, gran, transpose=transpose, stats=stats)
        quantize(xb, fmt.dtype, scale=one, transpose=transpose, stats=stats)
    # The fused prologue casts a training step runs (a given scale or 1x128, x^T, telemetry's stats).
    norm_w, gate_up = torch.ones(K, device="cuda"), torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
    for (gran, scale), transpose, stats in itertools.product((("tensorwise", one), ("block_1x128", None)),
                                                             (False, True), (False, True)):
        rmsnorm_quantize(xb, norm_w, 1e-5, E4M3.dtype, gran, scale=scale, transpose=transpose, stats=stats)
        for channel_scale in (None, torch.ones(K, device="cuda")):
            swiglu_quantize(gate_up, channel_scale, E4M3.dtype, gran, scale=scale, transpose=transpose, stats=stats)
    torch.cuda.synchronize()
    casts = (Q._tile_amax_kernel, Q._cast_tile_kernel, NQ._rmsnorm_quantize_kernel, NQ._swiglu_quantize_kernel)
    for jit_fn in casts:
        for i, kernel in enumerate(_compiled_kernels(jit_fn)):
            row = _row("quantize", f"{jit_fn.fn.__name__} variant {i}", kernel)
            rows.append(row)
            print(f"| quantize | {row['name']} | | {row['n_regs']} | {row['n_spills']} | "
                  f"{row['shared_bytes'] / 1024:.0f} | |")
            if row["n_spills"]:
                failures.append(f"{row['name']}: {row['n_spills']} spilled registers")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "failures": failures}, f, indent=1)
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
