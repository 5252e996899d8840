"""Offline sm_90a compile of the fused RMSNorm -> FP8 and SwiGLU -> FP8 Triton kernels (no GPU needed): registers,
spills, shared memory per variant (given scale / 1x128, Smooth-SwiGLU scales, with and without the cast's
saturated/flushed counts of telemetry), with kernel_audit.py's stand-in Hopper driver and the wheel's ptxas.

    python tools/bench/audit_norm_quantize.py

Exits 1 when a variant fails to compile or spills, 2 when the Triton wheel has no ptxas.
"""
from __future__ import annotations

import os
import sys

from kernel_audit import CompileRecorder, ptxas_path, ptxas_resources  # beside this script

sys.path.insert(0, os.getcwd())  # the checkout being audited (run from its root)

KERNELS = ("_rmsnorm_quantize_kernel", "_swiglu_quantize_kernel")


def main() -> int:
    import torch

    from megafp8_kernels.norm_quantize_triton import rmsnorm_quantize_triton, swiglu_quantize_triton

    ptxas = ptxas_path()
    if ptxas is None:
        print("the Triton wheel ships no ptxas: cannot read registers/spills")
        return 2
    x, weight = torch.randn(256, 384).to(torch.bfloat16), torch.ones(384)
    gate_up, channel_scale = torch.randn(256, 768).to(torch.bfloat16), torch.ones(384)
    variants = []  # (label, the kernels its call compiled)
    with CompileRecorder() as rec:
        for gran, scale in (("tensorwise", torch.ones(())), ("block_1x128", None)):  # training: with x^T
            cast = "given scale" if scale is not None else gran
            for stats in (False, True):
                kw = dict(scale=scale, transpose=True, stats=stats)
                label = f"{cast}{', stats' if stats else ''}"
                for s, what in ((None, ""), (channel_scale, ", Smooth-SwiGLU scales")):
                    start = len(rec.kernels)
                    swiglu_quantize_triton(gate_up, s, torch.float8_e4m3fn, gran, **kw)
                    variants.append((label + what, rec.kernels[start:]))
                start = len(rec.kernels)
                rmsnorm_quantize_triton(x, weight, 1e-5, torch.float8_e4m3fn, gran, **kw)
                variants.append((label, rec.kernels[start:]))
    failures, seen = 0, set()
    print("| kernel | variant | registers | spill bytes (st/ld) | shared KB |")
    print("|---|---|---|---|---|")
    for label, kernels in variants:
        for name, kernel in kernels:
            if name not in KERNELS or (name, kernel.hash) in seen:
                continue
            seen.add((name, kernel.hash))
            res = ptxas_resources(kernel.asm["ptx"], ptxas)
            spills = (res.get("spill_store_bytes", 0), res.get("spill_load_bytes", 0))
            failures += any(spills)
            print(f"| {name} | {label} | {res.get('registers')} | {spills[0]}/{spills[1]} | "
                  f"{kernel.metadata.shared / 1024:.0f} |")
    return 1 if failures or not seen else 0


if __name__ == "__main__":
    sys.exit(main())
