"""Offline sm_90a compile of the fused RMSNorm -> FP8 and SwiGLU -> FP8 Triton kernels (no GPU needed): registers,
spills, shared memory per variant (given scale / 1x128, with and without the transposed copy, Smooth-SwiGLU scales,
with and without the cast's saturated/flushed counts of telemetry), with kernel_audit.py's stand-in Hopper driver and
the wheel's ptxas. kernel_audit.py audits the same rows among all the others; this prints only these.

    python tools/bench/audit_norm_quantize.py [--triton 3.6.0]

Exits 1 when a variant fails to compile or spills, 2 when the Triton wheel has no ptxas, 3 when --triton's side venv
cannot be made because the wheel cannot be downloaded.
"""
from __future__ import annotations

import argparse
import os
import sys

from kernel_audit import norm_quantize_rows, ptxas_path, under_triton  # beside this script

sys.path.insert(0, os.getcwd())  # the checkout being audited (run from its root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", metavar="VERSION", help="audit under this Triton release, from a side venv "
                        "(triton_side_venv.sh) when the installed one differs")
    args = parser.parse_args(argv)
    if args.triton:
        code = under_triton(args.triton, __file__, sys.argv[1:] if argv is None else argv)
        if code is not None:
            return code
    ptxas = ptxas_path()
    if ptxas is None:
        print("the Triton wheel ships no ptxas: cannot read registers/spills")
        return 2
    import triton

    failures: list[str] = []
    rows = norm_quantize_rows(ptxas, failures)
    print(f"Triton {triton.__version__}, sm_90a")
    print("| kernel | launch | variant | registers | spill bytes (st/ld) | shared KB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['config']} | {r['case']} | {r['registers']} | "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['shared_bytes'] / 1024:.0f} |")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
