"""Benchmark FP8 GEMMs (TFLOP/s) and quantization (GB/s): ours (Triton) against bf16 matmul and torch._scaled_mm.

Also prints, per scale mode, whether the Triton kernel or torch._scaled_mm is faster and the
MEGAFP8_SCALED_MM_MODES value that follows (the dispatcher's per-mode choice, see kernels/scaled_mm.py).

GPU (the real measurement; results go into docs/benchmarks.md with date, GPU, versions, command):
    python tools/bench/bench_gemm.py
CPU smoke run (reference path, small sizes; exercises the script in CI, its numbers mean little):
    python tools/bench/bench_gemm.py --quick
wgrad only (Triton's accumulate into the fp32 main_grad vs torch._scaled_mm then main_grad.add_):
    python tools/bench/bench_gemm.py --wgrad [--quick]
The quantize table under another launch of the cast kernels (TILES_PER_PROGRAM, SLAB, SLAB_TRANSPOSED, WARPS of
kernels/quantize_triton.py, default 4,32,16,4; 1,32,16,4: one K tile per program, 4x the programs; every
4-warp launch with these slabs compiles without spills for sm_90a, larger slabs or 8 warps may spill):
    python tools/bench/bench_gemm.py --quantize-only --quantize-launch 1,32,16,4

Times are medians of repeated runs after warm-up (CUDA events via triton.testing.do_bench on GPU).
GB/s counts the fewest bytes an op must move: each input read once, each output written once.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from megafp8_kernels import E4M3, fp8_gemm, quantize
from megafp8_kernels.gemm import AUTOTUNE_ENV_VAR

# A benchmark measures the best launch config per shape: tune (training launches the audited default unless told).
os.environ.setdefault(AUTOTUNE_ENV_VAR, "1")

GPU_SQUARE = [2048, 4096, 8192]
GPU_LLAMA8B = [(8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (8192, 6144, 4096)]  # (M, N, K)
CPU_QUICK = [(128, 128, 128), (256, 256, 256)]
# wgrad dW (out, in) = dY^T (out, tokens) @ X (tokens, in), as GEMM (M, N, K) = (out, in, tokens): Llama-3-8B's
# projections at 8192 tokens per micro-batch and TP 1.
GPU_WGRAD = [(4096, 4096, 8192), (14336, 4096, 8192), (4096, 14336, 8192), (6144, 4096, 8192)]
SCALED_MM_CHOICES = ("tensorwise", "rowwise")  # the modes dispatch may send to torch._scaled_mm


def _time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    fn()  # warm-up
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _gemm_cases(M: int, N: int, K: int, device: str, fp8_backend: str):
    """name -> zero-argument callable, all computing a (M, N) product of (M, K) x (N, K)^T."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g)
    w = torch.randn(N, K, device=device, generator=g)
    hp = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 matmul is ~50x slower than fp32 on CPU
    x_hp, w_hp = x.to(hp), w.to(hp)
    cases = {f"{str(hp).removeprefix('torch.')} torch.matmul": lambda: x_hp @ w_hp.t()}

    qt_x, qt_w = quantize(x, E4M3.dtype, "tensorwise"), quantize(w, E4M3.dtype, "tensorwise")
    qr_x, qr_w = quantize(x, E4M3.dtype, "rowwise"), quantize(w, E4M3.dtype, "rowwise")
    qb_x, qb_w = quantize(x, E4M3.dtype, "block_1x128"), quantize(w, E4M3.dtype, "block_128x128")
    out = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        torch._scaled_mm(qt_x.data, qt_w.data.t(), qt_x.scale_inv, qt_w.scale_inv, out_dtype=out)
        cases["torch._scaled_mm tensorwise"] = lambda: torch._scaled_mm(
            qt_x.data, qt_w.data.t(), qt_x.scale_inv, qt_w.scale_inv, out_dtype=out)
        sb_row = qr_w.scale_inv.t().contiguous()
        torch._scaled_mm(qr_x.data, qr_w.data.t(), qr_x.scale_inv, sb_row, out_dtype=torch.bfloat16)
        cases["torch._scaled_mm rowwise"] = lambda: torch._scaled_mm(
            qr_x.data, qr_w.data.t(), qr_x.scale_inv, sb_row, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:  # older torch or unsupported device
        print(f"# torch._scaled_mm skipped: {err}".splitlines()[0], file=sys.stderr)
    label = "triton" if fp8_backend == "triton" else "reference"
    operands = {"tensorwise": (qt_x, qt_w), "rowwise": (qr_x, qr_w), "blockwise": (qb_x, qb_w)}
    for name, (qa, qb) in operands.items():
        cases[f"megafp8 {label} {name}"] = (
            lambda qa=qa, qb=qb: fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=out, backend=fp8_backend))
    # The dispatcher's torch._scaled_mm path, through the same custom op as the Triton rows (bf16 out:
    # the only rowwise output _scaled_mm takes).
    for name in SCALED_MM_CHOICES:
        qa, qb = operands[name]
        cases[f"megafp8 scaled_mm {name}"] = (lambda qa=qa, qb=qb: fp8_gemm(
            qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=torch.bfloat16, backend="scaled_mm"))
    return cases


def _scaled_mm_recommendation(rows: list[dict], triton_label: str) -> str:
    """Per mode, the geometric-mean time ratio Triton / _scaled_mm over all shapes, and the resulting
    MEGAFP8_SCALED_MM_MODES setting (modes where _scaled_mm is faster)."""
    faster, lines = [], []
    for mode in SCALED_MM_CHOICES:
        ratios = []
        for shape in {(r["M"], r["N"], r["K"]) for r in rows if r["kind"] == "gemm"}:
            times = {r["name"]: r["ms"] for r in rows if r["kind"] == "gemm" and (r["M"], r["N"], r["K"]) == shape}
            ours, theirs = times.get(f"megafp8 {triton_label} {mode}"), times.get(f"megafp8 scaled_mm {mode}")
            if ours and theirs:
                ratios.append(ours / theirs)
        if not ratios:
            continue
        geomean = statistics.geometric_mean(ratios)
        lines.append(f"# {mode}: {triton_label} time / scaled_mm time = {geomean:.2f} (geometric mean of {len(ratios)} shapes)")
        if geomean > 1.0:
            faster.append(mode)
    lines.append(f"# recommended: MEGAFP8_SCALED_MM_MODES={','.join(faster) or 'none'}")
    return "\n".join(lines)


def _wgrad_cases(M: int, N: int, K: int, device: str, fp8_backend: str):
    """(name -> callable adding one wgrad product into an fp32 main_grad (M, N), that main_grad): the Triton
    kernel's fused accumulate (what the FP8 layers run) against torch._scaled_mm into a bf16 or fp32
    temporary then add_."""
    g = torch.Generator(device=device).manual_seed(1)
    dy_t = torch.randn(M, K, device=device, generator=g)  # dY^T: K-major over tokens, as the layer's cast+transpose gives
    x_t = torch.randn(N, K, device=device, generator=g)
    main_grad = torch.zeros(M, N, device=device)
    cases = {}
    for mode in SCALED_MM_CHOICES:
        qa, qb = quantize(dy_t, E4M3.dtype, mode), quantize(x_t, E4M3.dtype, mode)
        cases[f"megafp8 {fp8_backend} {mode} accumulate into fp32"] = (
            lambda qa=qa, qb=qb: fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out=main_grad,
                                          accumulate=True, backend=fp8_backend))
        if mode == "tensorwise":
            sa, sb = qa.scale_inv.reshape(()), qb.scale_inv.reshape(())
        else:
            sa, sb = qa.scale_inv.reshape(-1, 1).contiguous(), qb.scale_inv.reshape(1, -1).contiguous()
        for out_dtype in ((torch.bfloat16, torch.float32) if mode == "tensorwise" else (torch.bfloat16,)):
            def scaled_mm_add(qa=qa, qb=qb, sa=sa, sb=sb, out_dtype=out_dtype):
                main_grad.add_(torch._scaled_mm(qa.data, qb.data.t(), sa, sb, out_dtype=out_dtype))
            try:
                scaled_mm_add()
            except (RuntimeError, NotImplementedError) as err:  # older torch or unsupported device/dtype
                print(f"# torch._scaled_mm {mode} {out_dtype} skipped: {err}".splitlines()[0], file=sys.stderr)
                continue
            cases[f"torch._scaled_mm {mode} {str(out_dtype).removeprefix('torch.')} + add_"] = scaled_mm_add
    return cases, main_grad


def _wgrad_summary(rows: list[dict], triton_label: str) -> str:
    """Per _scaled_mm variant, the geometric-mean time ratio (Triton accumulate) / (_scaled_mm + add_)."""
    lines = []
    wgrad = [r for r in rows if r["kind"] == "wgrad"]
    for name in sorted({r["name"] for r in wgrad if r["name"].startswith("torch._scaled_mm")}):
        mode = name.split()[1]
        ratios = []
        for shape in {(r["M"], r["N"], r["K"]) for r in wgrad}:
            times = {r["name"]: r["ms"] for r in wgrad if (r["M"], r["N"], r["K"]) == shape}
            ours = times.get(f"megafp8 {triton_label} {mode} accumulate into fp32")
            if ours and times.get(name):
                ratios.append(ours / times[name])
        if ratios:
            lines.append(f"# wgrad {mode}: {triton_label} accumulate time / ({name}) time = "
                         f"{statistics.geometric_mean(ratios):.2f} (geometric mean of {len(ratios)} shapes; > 1: "
                         f"_scaled_mm + add_ is faster)")
    lines.append("# wgrad routing is unchanged by this script: the FP8 layers accumulate through the Triton kernel")
    return "\n".join(lines)


def _quantize_cases(M: int, K: int, device: str, fp8_backend: str):
    """name -> (callable, minimal bytes moved). Input in bf16 on GPU (what a training step feeds), fp32 on CPU."""
    x = torch.randn(M, K, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)
    n, src = x.numel(), x.element_size()
    cases = {"device copy": (lambda: x.clone(), 2 * n * src)}
    for gran in ("tensorwise", "rowwise", "block_1x128", "block_128x128"):
        cases[f"quantize {gran}"] = (lambda gran=gran: quantize(x, E4M3.dtype, gran, backend=fp8_backend), n * (src + 1))
        cases[f"cast+transpose {gran}"] = (
            lambda gran=gran: quantize(x, E4M3.dtype, gran, transpose=True, backend=fp8_backend), n * (src + 2))
    return cases


def quantize_launch(text: str) -> dict[str, int]:
    """--quantize-launch TILES,SLAB,SLAB_TRANSPOSED,WARPS -> the quantize_triton constants it sets."""
    names = ("TILES_PER_PROGRAM", "SLAB", "SLAB_TRANSPOSED", "WARPS")
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(names) or any(v <= 0 or v & (v - 1) for v in values) or values[1] > 128 or values[2] > 128:
        raise argparse.ArgumentTypeError(f"'{text}': expected TILES,SLAB,SLAB_TRANSPOSED,WARPS, four powers of two "
                                         "with both slabs <= 128 (e.g. 1,32,16,4)")
    return dict(zip(names, values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run on small sizes (reference kernels)")
    parser.add_argument("--wgrad", action="store_true",
                        help="only wgrad: Triton accumulate into fp32 main_grad vs torch._scaled_mm + add_")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--gemm-only", action="store_true", help="skip the quantize table")
    only.add_argument("--quantize-only", action="store_true", help="skip the GEMM table")
    parser.add_argument("--quantize-launch", type=quantize_launch, metavar="TILES,SLAB,SLAB_T,WARPS",
                        help="time the casts under this launch of kernels/quantize_triton.py (GPU only)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    fp8_backend = "triton" if device == "cuda" else "reference"
    shapes = [(s, s, s) for s in GPU_SQUARE] + GPU_LLAMA8B if device == "cuda" else CPU_QUICK
    hw = torch.cuda.get_device_name() if device == "cuda" else f"CPU {platform.processor() or platform.machine()}"
    print(f"# device: {hw} | torch {torch.__version__} | fp8 kernels: {fp8_backend}")
    launch = ""
    if args.quantize_launch:
        if fp8_backend != "triton":
            parser.error("--quantize-launch sets the Triton casts' launch: it needs a CUDA GPU")
        from megafp8_kernels import quantize_triton

        for name, value in args.quantize_launch.items():
            setattr(quantize_triton, name, value)  # read by quantize_triton() at each launch
        launch = " [launch " + ",".join(str(v) for v in args.quantize_launch.values()) + "]"
        print(f"# cast launch: {args.quantize_launch}")
    rows = []

    def add(row: dict) -> None:
        """Keep a row, and rewrite --json with every row so far: a step cut short by its timeout keeps them."""
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": hw, "torch": torch.__version__, "rows": rows}, f, indent=1)

    if args.wgrad:
        print("\n| M | N | K | wgrad into fp32 main_grad | ms | TFLOP/s |\n|---|---|---|---|---|---|")
        for M, N, K in GPU_WGRAD if device == "cuda" else CPU_QUICK:
            for name, fn in _wgrad_cases(M, N, K, device, fp8_backend)[0].items():
                ms = _time_ms(fn, device)
                add({"kind": "wgrad", "M": M, "N": N, "K": K, "name": name, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9})
                print(f"| {M} | {N} | {K} | {name} | {ms:.3f} | {rows[-1]['tflops']:.1f} |")
        print()
        print(_wgrad_summary(rows, fp8_backend))
        return 0

    print("\n| M | N | K | GEMM | ms | TFLOP/s |\n|---|---|---|---|---|---|")
    for M, N, K in [] if args.quantize_only else shapes:
        for name, fn in _gemm_cases(M, N, K, device, fp8_backend).items():
            ms = _time_ms(fn, device)
            tflops = 2 * M * N * K / ms / 1e9
            add({"kind": "gemm", "M": M, "N": N, "K": K, "name": name, "ms": ms, "tflops": tflops})
            print(f"| {M} | {N} | {K} | {name} | {ms:.3f} | {tflops:.1f} |")

    print("\n| M | K | op | ms | GB/s | % of copy |\n|---|---|---|---|---|---|")
    for M, _, K in [] if args.gemm_only else shapes[: len(GPU_SQUARE) if device == "cuda" else len(CPU_QUICK)]:
        copy_gbs = None
        for name, (fn, nbytes) in _quantize_cases(M, K, device, fp8_backend).items():
            name += launch if name != "device copy" else ""
            ms = _time_ms(fn, device)
            gbs = nbytes / ms / 1e6
            copy_gbs = copy_gbs or gbs
            add({"kind": "quantize", "M": M, "K": K, "name": name, "ms": ms, "gbs": gbs})
            print(f"| {M} | {K} | {name} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")

    print()
    if device == "cuda" and not args.quantize_only:
        print(_scaled_mm_recommendation(rows, fp8_backend))
    else:
        print("# no scaled_mm recommendation on CPU: the dispatcher runs the reference twin there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
