"""Offline sm_90a audit of the Triton kernels: compile without a GPU, then registers/spills/smem and the GEMM's PTX.

    python tools/bench/kernel_audit.py [--quick] [--markdown FILE] [--json FILE]

No GPU is needed. A stand-in active driver reports an H100/H200 (`GPUTarget("cuda", 90, 32)`, which
Triton compiles as sm_90a) and every `JITFunction.run` is turned into a warm-up (compile, never launch),
so the real host code paths (`fp8_gemm_triton(..., config=...)`, `quantize_triton`) run on CPU tensors
and specialize exactly as they would on the device (16-byte alignment, int divisibility). Each compiled
kernel's PTX goes through the Triton wheel's own `ptxas -arch=sm_90a -v` for registers, spill bytes and
stack; shared memory is Triton's metadata. For the GEMM the PTX is also searched for the Hopper features
that make it fast: `wgmma.mma_async` (tensor cores), the largest `wgmma.wait_group N` (N >= 1: a wgmma
group stays in flight while the next is issued) and `cp.async.bulk.tensor` (TMA loads).

Exits 1 when an offered config fails to compile or spills, 2 when the Triton wheel has no ptxas.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class _CompileOnlyHopperDriver:
    """Triton's CUDA driver as seen by the compiler only: an sm_90 device 0 that nothing runs on."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaDriver

        self._real = CudaDriver.__new__(CudaDriver)  # no CudaUtils(): that would load libcuda

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return (9, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return self._real.map_python_to_cpp_type(ty)

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def is_active():
        return True


def ptxas_path() -> str | None:
    """The Triton wheel's ptxas for sm_90 (the one Triton itself would use), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:
        return None
    return path if path and os.path.exists(path) else None


def ptxas_resources(ptx: str, ptxas: str) -> dict:
    """Registers, spill bytes and stack frame from `ptxas -arch=sm_90a -v` of one kernel's PTX, and the
    wgmma waits of the SASS it produced (sass_wait_features)."""
    nvdisasm = Path(ptxas).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as scratch:
        src, cubin = Path(scratch) / "k.ptx", Path(scratch) / "k.cubin"
        src.write_text(ptx)
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                                capture_output=True, text=True, timeout=300)
        sass = ""
        if result.returncode == 0 and nvdisasm.exists():
            sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                                  timeout=300).stdout
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log[-500:]}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else 0,
            "spill_load_bytes": int(spills.group(2)) if spills else 0,
            "stack_bytes": int(stack.group(1)) if stack else 0,
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log,
            **sass_wait_features(sass)}


def sass_wait_features(sass: str) -> dict:
    """Whether a wgmma group really stays in flight, read from SASS, where ptxas's own waits show.

    A PTX `wgmma.wait_group 1` is not enough: when code reads a wgmma's registers before its wait, ptxas
    inserts `WARPGROUP.DEPBAR.LE gsb0, 0x0` itself (right before the PTX's wait 1, e.g. Triton's
    max_num_imprecise_acc promotion). Counted as in flight: a `DEPBAR.LE gsb0, N >= 1` whose previous
    wgmma-ordering instruction is a wgmma (QGMMA/HGMMA...), not another wait, and FP math (FMUL/FFMA/FADD)
    before the next wait is counted too (per kernel, all such windows): work the CUDA cores do while the
    tensor cores still run, e.g. the blockwise promotion of the previous K step."""
    if not sass:
        return {"sass_wait_in_flight": None, "sass_math_under_wait": None}
    events = re.findall(r"(\w*GMMA\.|WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)|\bF(?:MUL|FMA|ADD)\b)", sass)
    in_flight, math_under_wait = False, 0
    previous, open_window = None, False
    for token, count in events:
        if token.endswith("GMMA."):
            previous, open_window = "mma", False
        elif token.startswith("WARPGROUP"):
            real = int(count, 16) >= 1 and previous == "mma"
            in_flight |= real
            previous, open_window = "wait", real
        elif open_window:
            math_under_wait += 1
    return {"sass_wait_in_flight": in_flight, "sass_math_under_wait": math_under_wait}


def ptx_features(ptx: str) -> dict:
    """The Hopper GEMM features visible in PTX."""
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    return {"wgmma": "wgmma.mma_async" in ptx, "max_wgmma_wait_group": max(waits) if waits else None,
            "tma_loads": "cp.async.bulk.tensor" in ptx, "cp_async": bool(re.search(r"cp\.async\.(ca|cg)", ptx))}


class CompileRecorder:
    """Within `with`: the stand-in driver is active and every JIT launch compiles only; `kernels` collects them."""

    def __enter__(self):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self.kernels, self._driver, self._jit = [], driver, JITFunction
        self._run = JITFunction.run
        recorder = self

        def compile_only(fn, *args, grid, warmup, **kwargs):
            kernel = recorder._run(fn, *args, grid=grid, warmup=True, **kwargs)
            recorder.kernels.append((fn.fn.__name__, kernel))
            return kernel

        self._previous = driver._active  # None without a GPU: reset_active() would fail there
        driver.set_active(_CompileOnlyHopperDriver())
        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc):
        self._jit.run = self._run
        self._driver._active = self._previous
        return False


def gemm_cases(quick: bool):
    """(label, offered, kwargs for fp8_gemm_triton's inputs) of every GEMM specialization to audit."""
    import torch

    from megafp8_kernels import gemm as G
    from megafp8_kernels.scaling import GemmScaleMode

    modes = [GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE, GemmScaleMode.BLOCKWISE_1X128]
    configs = [(c, True) for c in G.SM90_CONFIGS] + [(c, False) for c in G.SM90_REJECTED_CONFIGS]
    if quick:
        configs = [(G.SM90_DEFAULT_CONFIG, True)]
    shapes = [(512, 512, 512), (70, 90, 300)]  # aligned, and odd sizes whose strides are not multiples of 16
    for config, offered in configs:
        for mode in modes:
            for M, N, K in shapes if offered else shapes[:1]:
                for fast in ((False, True) if mode in (GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE) else (False,)):
                    if quick and (M, N, K) != shapes[0] and mode != GemmScaleMode.BLOCKWISE:
                        continue
                    yield config, offered, mode, (M, N, K), fast, "triton"
    # The precise path's Gluon kernel (gemm_hopper.py, MEGAFP8_GEMM_PRECISE_KERNEL=gluon): every mode, both sizes.
    for mode in modes:
        for M, N, K in shapes:
            if quick and (M, N, K) != shapes[0] and mode != GemmScaleMode.BLOCKWISE:
                continue
            yield G.SM90_PROMOTED_CONFIG, True, mode, (M, N, K), False, "gluon"


def _scales(mode, M, N, K):
    import torch

    from megafp8_kernels.scaling import GemmScaleMode, empty_scales, granularity

    gran_a, gran_b = mode.operand_granularities
    sa = empty_scales(M, K, granularity(gran_a), torch.device("cpu")).fill_(1.0)
    sb = empty_scales(N, K, granularity(gran_b), torch.device("cpu")).fill_(1.0)
    return sa, sb


def audit(quick: bool = False, shard: tuple[int, int] = (0, 1)) -> tuple[list[dict], list[str]]:
    import torch

    from megafp8_kernels import gemm as G
    try:  # Gluon's Hopper API moves between Triton releases: without it, its rows fail and the rest still run
        from megafp8_kernels.gemm_hopper import HOPPER_GEMM_KERNEL_NAME as GLUON_GEMM_KERNEL_NAME
    except ImportError as err:
        GLUON_GEMM_KERNEL_NAME, gluon_error = None, f"Gluon kernel unavailable: {err}"

    ptxas = ptxas_path()
    rows, failures = [], []
    for case_index, (config, offered, mode, (M, N, K), fast, precise_kernel) in enumerate(gemm_cases(quick)):
        if case_index % shard[1] != shard[0]:
            continue
        c = config.kwargs
        label = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
        if precise_kernel == "gluon":
            label += " gluon"
        elif config is G.SM90_DEFAULT_CONFIG:
            label += " (default)"
        name = f"{mode.value}{' fast-accum' if fast else ''} {M}x{N}x{K}"
        a = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
        b = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
        sa, sb = _scales(mode, M, N, K)
        row = {"kernel": "fp8_gemm", "config": label, "case": name, "offered": offered, "precise_kernel": precise_kernel}
        try:
            if precise_kernel == "gluon" and GLUON_GEMM_KERNEL_NAME is None:
                raise RuntimeError(gluon_error)
            with CompileRecorder() as rec:
                G.fp8_gemm_triton(a, b, sa, sb, out_dtype=torch.bfloat16, config=config, fast_accum=fast,
                                  precise_kernel=precise_kernel)
            (fn_name, kernel), = [k for k in rec.kernels if k[0] in (G.GEMM_KERNEL_NAME, GLUON_GEMM_KERNEL_NAME)]
            row.update(_describe(kernel, ptxas))
        except Exception as err:
            row["error"] = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        rows.append(row)
        if offered and ("error" in row or row.get("spill_store_bytes") or row.get("spill_load_bytes")):
            failures.append(f"gemm {label} {name}: {row.get('error') or 'spills'}")
        elif (fast or precise_kernel == "gluon") and ptxas and not (row.get("sass_wait_in_flight")
                                                                   and not row.get("wgmma_serialized")):
            failures.append(f"gemm {label} {name}: no wgmma group in flight in the SASS mainloop")

    if shard[0] != 0:  # the quantize kernels go with the first shard
        return rows, failures
    rows += quantize_rows(ptxas, failures)
    return rows, failures


def quantize_cases():
    """(case label, quantize_triton kwargs) of every quantize specialization: each granularity, and the given
    (delayed) scale, with and without the transposed copy and the stats counts."""
    import torch

    for gran in ("tensorwise", "rowwise", "block_1x128", "block_128x128", "given scale"):
        for transpose in (False, True):
            for stats in (False, True):
                kwargs = dict(granularity_=gran, transpose=transpose, stats=stats)
                if gran == "given scale":
                    kwargs.update(granularity_="tensorwise", scale=torch.ones(()))
                yield f"{gran}{' transpose' if transpose else ''}{' stats' if stats else ''}", kwargs


def quantize_rows(ptxas: str | None, failures: list[str]) -> list[dict]:
    """One row per distinct compiled quantize kernel (the amax kernel is shared by several casts: it is
    listed under the first), labelled with its launch: warps, tiles per program, rows held at once."""
    import torch

    from megafp8_kernels import quantize_triton as Q

    x = torch.randn(256, 384).to(torch.bfloat16)
    rows, seen = [], set()
    for case, kwargs in quantize_cases():
        with CompileRecorder() as rec:
            Q.quantize_triton(x, torch.float8_e4m3fn, **kwargs)
        for fn_name, kernel in rec.kernels:
            if (fn_name, kernel.hash) in seen:
                continue
            seen.add((fn_name, kernel.hash))
            held = Q.SLAB_TRANSPOSED if kwargs["transpose"] else Q.SLAB
            held = f"{held}x{Q.TILE} slabs" if fn_name == "_cast_tile_kernel" else f"{Q.TILE}x{Q.TILE} tiles"
            row = {"kernel": fn_name, "config": f"w{kernel.metadata.num_warps} {Q.TILES_PER_PROGRAM} tiles/program "
                   f"{held}", "case": case, "offered": True, **_describe(kernel, ptxas)}
            rows.append(row)
            if row.get("spill_store_bytes") or row.get("spill_load_bytes"):
                failures.append(f"{fn_name} {case}: spills")
    return rows


def _describe(kernel, ptxas: str | None) -> dict:
    ptx = kernel.asm["ptx"]
    info = {"shared_bytes": kernel.metadata.shared, **ptx_features(ptx)}
    if ptxas:
        info.update(ptxas_resources(ptx, ptxas))
    return info


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | config | case | registers | spill bytes (st/ld) | shared KB | max wgmma.wait_group (PTX) "
             "| wgmma in flight (SASS) | TMA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        config = r["config"] + ("" if r["offered"] else " (not offered)")
        if "error" in r:
            lines.append(f"| {r['kernel']} | {config} | {r['case']} | failed: {r['error']} | | | | | |")
            continue
        wait = "-" if r["max_wgmma_wait_group"] is None else str(r["max_wgmma_wait_group"])
        flight = {None: "-", False: "no", True: "yes"}[r.get("sass_wait_in_flight") if r["wgmma"] else None]
        if flight == "yes" and r.get("sass_math_under_wait"):
            flight = f"yes, {r['sass_math_under_wait']} FP ops under it"
        lines.append(f"| {r['kernel']} | {config} | {r['case']} | {r.get('registers')} | "
                     f"{r.get('spill_store_bytes')}/{r.get('spill_load_bytes')} | {r['shared_bytes'] / 1024:.0f} | "
                     f"{wait} | {flight} | {'yes' if r['tma_loads'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the default GEMM config (a representative set)")
    parser.add_argument("--shard", default="0/1", help="I/N: audit every N-th case from the I-th (parallel precompiles)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the audit compiles real kernels; unset it")
    if ptxas_path() is None:
        print("kernel_audit: the Triton wheel has no ptxas for sm_90a; cannot audit", file=sys.stderr)
        return 2
    try:
        index, count = (int(part) for part in args.shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        parser.error(f"--shard {args.shard!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    rows, failures = audit(args.quick, shard=(index, count))
    table = markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
