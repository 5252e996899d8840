"""Offline sm_100a audit of the microscaling kernels: block-scaled GEMM and quantizers, compiled without a GPU.

    python tools/bench/kernel_audit_blackwell.py [--quick] [--markdown FILE] [--json FILE]

kernel_audit.py's method (a stand-in driver, every JIT launch a compile-only warm-up, the real host code on CPU
tensors) with a Blackwell target, GPUTarget("cuda", 100, 32), which Triton compiles as sm_100a. Each kernel's PTX
goes through the wheel's own ptxas for that arch (`get_ptxas(100)`: ptxas-blackwell in Triton 3.9) with -v for
registers, spill bytes and stack; shared memory and tensor memory are Triton's metadata. Audited:
  block_scaled_gemm   every offered config (MX8_CONFIGS for FP8 pairs, FP4_CONFIGS for E2M1 pairs) x each pair a
                      training step runs: MXFP8 E4M3 x E4M3 (fprop), E5M2 x E4M3 (dgrad), MXFP4, NVFP4 1x16 x 16x16
                      (fprop/dgrad) and 1x16 x 1x16 (wgrad into fp32), at 512^3 and an odd 70x90x320; the PTX must
                      hold `tcgen05.mma ... block_scale` and the SASS a UTC*MMA with three tensor-memory operands
                      (accumulator, A scales, B scales): the native block-scaled MMA, not an upcast;
  quantize            every specialization quantize_microscaled_triton compiles (MX E4M3/E5M2/E2M1 RCEIL and
                      floor, NVFP4 1x16/16x16 with own or given S_enc, transposed copies with and without the Hadamard
                      transform, stochastic rounding, stats), row and transposed copy, plus the NVFP4 amax pass.
Also compiled for sm_90a (one config per GEMM pair): Triton upcasts dot_scaled to bf16 there (wgmma bf16, no block
scale), recorded as "emulated": Hopper runs these recipes for numerics studies only.
Exit 1: a compile error, a spill, or a Blackwell GEMM without the block-scaled MMA (or a Hopper one with it, which
would mean the docs are stale); 2: the wheel has no ptxas that takes sm_100a.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_audit  # noqa: E402  (beside this script: the stand-in driver and the compile recorder)

REPO = Path(__file__).resolve().parents[2]
BLACKWELL, HOPPER = 100, 90


class _CompileOnlyDriver(kernel_audit._CompileOnlyHopperDriver):
    """kernel_audit's stand-in driver with another compute capability (100: sm_100a, 90: sm_90a)."""

    def __init__(self, arch: int):
        super().__init__()
        self.arch = arch

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_device_capability(self, device=None):
        return divmod(self.arch, 10)

    def get_current_device(self):
        # Triton keeps one in-memory kernel cache per device, holding the target it first saw: one device per arch,
        # or an sm_90a compile after an sm_100a one would reuse the sm_100a kernel.
        return self.arch


class TargetRecorder(kernel_audit.CompileRecorder):
    """kernel_audit.CompileRecorder for `arch`: within `with`, every JIT launch compiles for it and is collected."""

    def __init__(self, arch: int):
        self.arch = arch

    def __enter__(self):
        super().__enter__()
        self._driver.set_active(_CompileOnlyDriver(self.arch))
        return self


def ptxas_path(arch: int = BLACKWELL) -> str | None:
    """The wheel's ptxas for `arch` (Triton's own choice) when it accepts sm_{arch}a, else None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception:
        return None
    if not path or not os.path.exists(path):
        return None
    usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
    return path if f"sm_{arch}a" in usage else None


def resources(ptx: str, ptxas: str, arch: int) -> dict:
    """Registers, spill bytes and stack from `ptxas -arch=sm_{arch}a -v`, and the SASS MMA opcodes (nvdisasm)."""
    with tempfile.TemporaryDirectory() as scratch:
        src, cubin = Path(scratch) / "k.ptx", Path(scratch) / "k.cubin"
        src.write_text(ptx)
        result = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", str(src), "-o", str(cubin)], capture_output=True,
                                text=True, timeout=300)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise RuntimeError(f"ptxas failed: {log[-500:]}")
        nvdisasm = Path(ptxas).with_name("nvdisasm")
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                              timeout=300).stdout if nvdisasm.exists() else ""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    mma = [line for line in sass.splitlines() if re.search(r"\b\w*MMA\b", line)]
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else 0,
            "spill_load_bytes": int(spills.group(2)) if spills else 0,
            "stack_bytes": int(stack.group(1)) if stack else 0,
            "sass_mma": sorted({re.search(r"\b([\w.]*MMA[\w.]*)", line).group(1) for line in mma}) if sass else None,
            # UTC*MMA D, SFA, SFB in tensor memory: the block-scaled form (an unscaled tcgen05 MMA has one tmem operand)
            "sass_block_scaled": any(line.count("tmem[") >= 3 for line in mma if "UTC" in line) if sass else None}


def describe(kernel, ptxas: str | None, arch: int) -> dict:
    ptx = kernel.asm["ptx"]
    meta = kernel.metadata
    info = {"shared_bytes": meta.shared, "tmem_columns": getattr(meta, "tmem_size", None) or 0,
            "num_warps": meta.num_warps,
            "ptx_mma": sorted(set(re.findall(r"(tcgen05\.mma[\w.:]*|wgmma\.mma_async[\w.:]*|mma\.sync[\w.:]*)", ptx))),
            "ptx_block_scaled": bool(re.search(r"tcgen05\.mma\S*block_scale", ptx))}
    if ptxas:
        info.update(resources(ptx, ptxas, arch))
    return info


# ---- cases --------------------------------------------------------------------------------------------------------

# (label, A format, A layout, B format, B layout, out dtype): the GEMMs a microscaled training step runs.
GEMM_PAIRS = (("mxfp8 fprop e4m3xe4m3 bf16", "e4m3", "mx_1x32", "e4m3", "mx_1x32", "bf16"),
              ("mxfp8 dgrad e5m2xe4m3 bf16", "e5m2", "mx_1x32", "e4m3", "mx_1x32", "bf16"),
              ("mxfp8 wgrad e5m2xe4m3 fp32", "e5m2", "mx_1x32", "e4m3", "mx_1x32", "fp32"),
              ("mxfp4 e2m1xe2m1 bf16", "e2m1", "mx_1x32", "e2m1", "mx_1x32", "bf16"),
              ("nvfp4 fprop 1x16x16x16 bf16", "e2m1", "nvfp4_1x16", "e2m1", "nvfp4_16x16", "bf16"),
              ("nvfp4 wgrad 1x16x1x16 fp32", "e2m1", "nvfp4_1x16", "e2m1", "nvfp4_1x16", "fp32"))
GEMM_SHAPES = ((512, 512, 512), (70, 90, 320))  # aligned; odd M, N and a K that is no multiple of BLOCK_K


def _operand(fmt_name: str, layout_name: str, rows: int, K: int):
    import torch

    from megafp8_kernels.formats import E2M1, E4M3, E5M2, scale_layout
    from megafp8_kernels.quantized_tensor import QuantizedTensor

    fmt = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}[fmt_name]
    layout = scale_layout(layout_name)
    data = torch.zeros(rows, K // 2, dtype=torch.uint8) if fmt is E2M1 else torch.zeros(rows, K, dtype=fmt.dtype)
    nvfp4 = layout_name.startswith("nvfp4")
    scales = torch.zeros(layout.scale_shape(rows, K), dtype=torch.float8_e4m3fn if nvfp4 else torch.uint8)
    return QuantizedTensor((rows, K), fmt, layout, data, scales, global_scale_inv=torch.ones(()) if nvfp4 else None)


def gemm_cases(quick: bool):
    """(arch, config, pair, shape): every offered config on sm_100a, HOPPER_CONFIG on sm_90a, at both shapes.
    --quick: the first (default) config only."""
    from megafp8_kernels import block_scaled_gemm as G

    for pair in GEMM_PAIRS:
        configs = G.FP4_CONFIGS if pair[1] == "e2m1" and pair[3] == "e2m1" else G.MX8_CONFIGS
        for config in configs[:1] if quick else configs:
            for shape in GEMM_SHAPES:
                yield BLACKWELL, config, pair, shape
        for shape in GEMM_SHAPES:
            yield HOPPER, G.HOPPER_CONFIG, pair, shape


def config_label(config) -> str:
    c = config.kwargs
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages}"


def quantize_cases():
    """(label, quantize_microscaled_triton kwargs) of every specialization it compiles (the formats by name)."""
    mx = [("mxfp8 e4m3", dict(fmt="e4m3", transpose=True, stats=True)),
          ("mxfp8 e5m2", dict(fmt="e5m2", transpose=True, stats=True)),
          ("mxfp8 e4m3 floor", dict(fmt="e4m3", transpose=True, stats=True, scale_rounding="floor")),
          ("mxfp4", dict(fmt="e2m1", transpose=True, stats=True)),
          ("mxfp4 sr", dict(fmt="e2m1", transpose=True, stats=True, key=1234)),
          ("mxfp4 sr rht", dict(fmt="e2m1", transpose=True, stats=True, key=1234, hadamard_transposed=True))]
    nv = [("nvfp4 1x16", dict(layout="nvfp4_1x16", transpose=True, stats=True)),
          ("nvfp4 1x16 sr", dict(layout="nvfp4_1x16", transpose=True, stats=True, key=1234)),
          ("nvfp4 1x16 rht", dict(layout="nvfp4_1x16", transpose=True, stats=True, hadamard_transposed=True)),
          ("nvfp4 1x16 sr rht", dict(layout="nvfp4_1x16", transpose=True, stats=True, key=1234,
                                     hadamard_transposed=True)),
          ("nvfp4 1x16 given S_enc", dict(layout="nvfp4_1x16", transpose=True, stats=True, encode_scale=1.0)),
          ("nvfp4 16x16", dict(layout="nvfp4_16x16", transpose=True, stats=True)),
          ("nvfp4 16x16 sr", dict(layout="nvfp4_16x16", transpose=True, stats=True, key=1234))]
    yield from ((label, {"layout": "mx_1x32", **kw}) for label, kw in mx)
    yield from ((label, {"fmt": "e2m1", **kw}) for label, kw in nv)


def _row(kernel: str, target: int, config: str, case: str, compiled, arch_ptxas: dict) -> dict:
    row = {"kernel": kernel, "target": f"sm_{target}a", "config": config, "case": case}
    row.update(describe(compiled, arch_ptxas.get(target), target))
    return row


def audit(quick: bool = False) -> tuple[list[dict], list[str]]:
    import torch

    from megafp8_kernels import block_scaled_gemm as G
    from megafp8_kernels import microscaling_triton as Q
    from megafp8_kernels.formats import E2M1, E4M3, E5M2, scale_layout

    arch_ptxas = {BLACKWELL: ptxas_path(BLACKWELL), HOPPER: kernel_audit.ptxas_path()}
    rows, failures = [], []
    for arch, config, pair, (M, N, K) in gemm_cases(quick):
        label, fa, la, fb, lb, out = pair
        case = f"{label} {M}x{N}x{K}"
        started = time.perf_counter()
        try:
            with TargetRecorder(arch):
                _, kernel = G.block_scaled_gemm_triton(
                    _operand(fa, la, M, K), _operand(fb, lb, N, K), config=config,
                    out_dtype=torch.float32 if out == "fp32" else torch.bfloat16)
            row = _row("block_scaled_gemm", arch, config_label(config), case, kernel, arch_ptxas)
        except Exception as err:
            row = {"kernel": "block_scaled_gemm", "target": f"sm_{arch}a", "config": config_label(config),
                   "case": case, "error": str(err).splitlines()[0][:160] if str(err) else type(err).__name__}
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows.append(row)
        name = f"block_scaled_gemm sm_{arch}a {row['config']} {case}"
        if "error" in row:
            failures.append(f"{name}: {row['error']}")
        elif row.get("spill_store_bytes") or row.get("spill_load_bytes"):
            failures.append(f"{name}: spills")
        elif arch == BLACKWELL and not (row["ptx_block_scaled"] and row.get("sass_block_scaled", True)):
            failures.append(f"{name}: no block-scaled tcgen05 MMA")
        elif arch == HOPPER and row["ptx_block_scaled"]:
            failures.append(f"{name}: a block-scaled MMA on sm_90a (the docs say Hopper upcasts)")

    formats = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}
    x = torch.randn(256, 384).to(torch.bfloat16)
    seen = set()
    for label, kwargs in quantize_cases():
        kw = dict(kwargs)
        fmt, layout = formats[kw.pop("fmt")], scale_layout(kw.pop("layout"))
        if "encode_scale" in kw:
            kw["encode_scale"] = torch.tensor(kw["encode_scale"])
        started = time.perf_counter()
        try:
            with TargetRecorder(BLACKWELL) as rec:
                Q.quantize_microscaled_triton(x, fmt, layout, **kw)
        except Exception as err:
            rows.append({"kernel": "quantize", "target": "sm_100a", "config": "", "case": label,
                         "error": str(err).splitlines()[0][:160] if str(err) else type(err).__name__})
            failures.append(f"quantize {label}: {rows[-1]['error']}")
            continue
        casts = 0
        for fn_name, kernel in rec.kernels:
            copy = ""
            if fn_name == "_microscaled_cast_kernel":
                copy = " row" if casts == 0 else " transposed"
                casts += 1
            if (fn_name, kernel.hash) in seen:
                continue
            seen.add((fn_name, kernel.hash))
            row = _row(fn_name, BLACKWELL, f"w{kernel.metadata.num_warps} {Q.ROWS}x{Q.COLS} tile", label + copy,
                       kernel, arch_ptxas)
            row["seconds"] = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            rows.append(row)
            if row.get("spill_store_bytes") or row.get("spill_load_bytes"):
                failures.append(f"{fn_name} {label + copy}: spills")
    return rows, failures


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | target | config | case | registers | spill bytes (st/ld) | shared KB | TMEM cols | MMA (PTX) "
             "| block-scaled (PTX / SASS) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['target']} | {r['config']} | {r['case']} | failed: {r['error']} "
                         "| | | | | |")
            continue
        mma = ", ".join(m.replace("tcgen05.mma.cta_group::1.", "tcgen05 ").replace("wgmma.mma_async.sync.aligned.",
                                                                                   "wgmma ") for m in r["ptx_mma"])
        scaled = "-" if not r["ptx_mma"] else ("yes" if r["ptx_block_scaled"] else "no (bf16 upcast)")
        if r["ptx_mma"] and r.get("sass_mma"):
            scaled += f" / {'yes' if r['sass_block_scaled'] else 'no'} ({', '.join(r['sass_mma'])})"
        lines.append(f"| {r['kernel']} | {r['target']} | {r['config']} | {r['case']} | {r.get('registers')} | "
                     f"{r.get('spill_store_bytes')}/{r.get('spill_load_bytes')} | {r['shared_bytes'] / 1024:.0f} | "
                     f"{r['tmem_columns'] or '-'} | {mma or '-'} | {scaled} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GEMMs: the default config only")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the audit compiles real kernels; unset it")
    if ptxas_path(BLACKWELL) is None:
        print("kernel_audit_blackwell: the Triton wheel has no ptxas that takes sm_100a; cannot audit", file=sys.stderr)
        return 2
    rows, failures = audit(args.quick)
    table = markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows, "failures": failures},
                                              indent=1))
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
