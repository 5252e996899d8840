"""Offline sm_90a audit of the Triton kernels: compile without a GPU, then registers/spills/smem and the GEMM's PTX.

    python tools/bench/kernel_audit.py [--quick] [--shard I/N] [--triton 3.6.0] [--markdown FILE] [--json FILE]

No GPU is needed. A stand-in active driver reports an H100/H200 (`GPUTarget("cuda", 90, 32)`, which
Triton compiles as sm_90a) and every `JITFunction.run` is turned into a warm-up (compile, never launch),
so the real host code paths (`fp8_gemm_triton(..., config=...)`, `quantize_triton`, the fused RMSNorm/SwiGLU
casts) run on CPU tensors and specialize exactly as they would on the device (16-byte alignment, int
divisibility). Audited: every GEMM a training step launches (fprop, dgrad with E5M2 gradients, wgrad accumulated
into the fp32 main_grad; gemm_cases) in each scale mode, on the Triton kernel and the Gluon one, every quantize
specialization (E4M3 and E5M2) and every fused prologue cast. Each compiled kernel's PTX goes through the Triton
wheel's own `ptxas -arch=sm_90a -v` for registers, spill bytes and stack; shared memory is Triton's metadata. For
the GEMM the PTX is also searched for the Hopper features that make it fast: `wgmma.mma_async` (tensor cores), the
largest `wgmma.wait_group N` (N >= 1: a wgmma group stays in flight while the next is issued) and
`cp.async.bulk.tensor` (TMA loads). `--triton VERSION` audits under another Triton release (the GPU image's torch
2.11 + CUDA 13 pins 3.6.0) from a side venv that triton_side_venv.sh makes once.

Also audited: the fused optimizer kernels (audit_optimizer_cases.py) at the launch sizes a CUDA device gets. Every
kernel compiled lands in TRITON_CACHE_DIR, where a later process on the GPU finds it (gpu_check.sh's precompile step).
`--shard I/N` audits one of N parts (audit_shards.py balances them by estimated compile seconds); each row says how
many seconds its compile and ptxas took.

Exit status 1 means a regression: an offered GEMM config or any cast or optimizer kernel fails to compile, spills, or
a fast/Gluon GEMM lost its wgmma group in flight. Spills known_spill() names (wgrad into fp32 at an N that is not a
multiple of 16, which no training shape has) are marked "known" in the table and listed as KNOWN lines, not failed.
2 when the Triton wheel has no ptxas, 3 when --triton's side venv cannot be made because the wheel cannot be
downloaded. --compare prints the --json reports of several runs (e.g. both Triton releases) as one table.
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
from typing import Callable, NamedTuple

from audit_grouped_gemm_cases import GROUPED_GEMM_CASES, GROUPED_WGRAD_CASES, grouped_gemm_cases, grouped_wgrad_cases
from audit_optimizer_cases import optimizer_cases  # beside this script
from audit_shards import shard_plan

REPO = Path(__file__).resolve().parents[2]
_STARTED = time.perf_counter()  # before torch and triton are imported: a shard's wall seconds include them


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


class GemmCase(NamedTuple):
    """One GEMM specialization to compile: launch config, mode, sizes and what a training step passes."""

    config: object  # triton.Config
    offered: bool
    mode: object  # GemmScaleMode
    shape: tuple[int, int, int]
    fast: bool
    precise_kernel: str  # "triton" or "gluon"
    gemm: str  # fprop, dgrad, wgrad (linear_function.py)
    a_dtype: str  # "e4m3" or "e5m2"
    out_dtype: str  # "bf16" or "fp32"
    accumulate: bool

    @property
    def name(self) -> str:
        """fprop keeps the short labels of earlier tables ("rowwise fast-accum 512x512x512"); the backward GEMMs
        say which, their operands and output: "blockwise_1x128 wgrad e5m2xe4m3 fp32+= 512x512x512"."""
        M, N, K = self.shape
        what = " fast-accum" if self.fast else ""
        if self.gemm != "fprop":
            what = f" {self.gemm} {self.a_dtype}xe4m3 {self.out_dtype}{'+=' if self.accumulate else ''}"
        return f"{self.mode.value}{what} {M}x{N}x{K}"


# The backward GEMMs of a training step (megafp8/fp8/linear_function.py), precise (fp32 promotion every 128 of K):
# dgrad dY (E5M2 in the default hybrid format) x W^T (E4M3) to bf16, and wgrad dY^T x x^T accumulated into the fp32
# main_grad (out=, accumulate=True). Per recipe: tensorwise/delayed and rowwise use the same mode for both; blockwise
# runs dgrad as 1x128 x 128x128 ("blockwise") and wgrad as 1x128 x 1x128, with E4M3 gradients by default (its
# E4M3 dgrad is the fprop case) and E5M2 ones with fp8_format="hybrid". fprop is E4M3 x E4M3 to bf16.
_BACKWARD_GEMMS = (("dgrad", "e5m2", "bf16", False, ("tensorwise", "rowwise", "blockwise")),
                   ("wgrad", "e5m2", "fp32", True, ("tensorwise", "rowwise", "blockwise_1x128")),
                   ("wgrad", "e4m3", "fp32", True, ("blockwise_1x128",)))


def gemm_cases(quick: bool):
    """Every GEMM specialization to audit (GemmCase). --quick: the default config and the Gluon kernel only, the
    odd size for fprop only in the blockwise mode, every backward GEMM at both sizes."""
    from megafp8_kernels import gemm as G
    from megafp8_kernels.scaling import GemmScaleMode

    modes = [GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE, GemmScaleMode.BLOCKWISE_1X128]
    configs = [(c, True) for c in G.SM90_CONFIGS] + [(c, False) for c in G.SM90_REJECTED_CONFIGS]
    if quick:
        configs = [(G.SM90_DEFAULT_CONFIG, True)]
    shapes = [(512, 512, 512), (70, 90, 300)]  # aligned, and odd sizes whose strides are not multiples of 16
    # The precise path's Gluon kernel (gemm_hopper.py, MEGAFP8_GEMM_PRECISE_KERNEL=gluon) runs every precise GEMM.
    kernels = [(config, offered, "triton") for config, offered in configs] + [(G.SM90_PROMOTED_CONFIG, True, "gluon")]
    for config, offered, precise_kernel in kernels:
        for mode in modes:
            for shape in shapes if offered else shapes[:1]:
                fast_options = (False, True) if mode in (GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE) else (False,)
                for fast in fast_options if precise_kernel == "triton" else (False,):
                    if quick and shape != shapes[0] and mode != GemmScaleMode.BLOCKWISE:
                        continue
                    yield GemmCase(config, offered, mode, shape, fast, precise_kernel, "fprop", "e4m3", "bf16", False)
        for gemm, a_dtype, out_dtype, accumulate, mode_names in _BACKWARD_GEMMS if offered else ():
            for mode in (GemmScaleMode(name) for name in mode_names):
                for shape in shapes:
                    yield GemmCase(config, offered, mode, shape, False, precise_kernel, gemm, a_dtype, out_dtype,
                                   accumulate)


def _fp8_dtype(name: str):
    import torch

    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]


def _scales(mode, M, N, K):
    import torch

    from megafp8_kernels.scaling import GemmScaleMode, empty_scales, granularity

    gran_a, gran_b = mode.operand_granularities
    sa = empty_scales(M, K, granularity(gran_a), torch.device("cpu")).fill_(1.0)
    sb = empty_scales(N, K, granularity(gran_b), torch.device("cpu")).fill_(1.0)
    return sa, sb


def audit(quick: bool = False, shard: tuple[int, int] = (0, 1)) -> tuple[list[dict], list[str]]:
    """(rows, failures) of this shard's cases (audit_shards.shard_plan: every case in one shard, shards balanced by
    their estimated compile seconds). A failure is a regression: a compile error, or spills in an offered config
    outside known_spill's rule (those rows carry "known_spill" and are listed, not failed)."""
    import torch

    from megafp8_kernels import gemm as G
    try:  # Gluon's Hopper API moves between Triton releases: without it, its rows fail and the rest still run
        from megafp8_kernels.gemm_hopper import HOPPER_GEMM_KERNEL_NAME as GLUON_GEMM_KERNEL_NAME
    except ImportError as err:
        GLUON_GEMM_KERNEL_NAME, gluon_error = None, f"Gluon kernel unavailable: {err}"

    plan = shard_plan(case_families(quick), shard[1])
    mine = lambda index: plan[index] == shard[0]  # noqa: E731
    ptxas = ptxas_path()
    rows, failures = [], []
    gemm_count = 0
    for case_index, case in enumerate(gemm_cases(quick)):
        gemm_count += 1
        if not mine(case_index):
            continue
        config, offered, mode, (M, N, K), fast, precise_kernel = case[:6]
        c = config.kwargs
        label = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
        if precise_kernel == "gluon":
            label += " gluon"
        elif config is G.SM90_DEFAULT_CONFIG:
            label += " (default)"
        name = case.name
        a = torch.zeros(M, K, dtype=_fp8_dtype(case.a_dtype))
        b = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
        sa, sb = _scales(mode, M, N, K)
        out_dtype = torch.float32 if case.out_dtype == "fp32" else torch.bfloat16
        out = torch.zeros(M, N, dtype=out_dtype) if case.accumulate else None
        row = {"kernel": "fp8_gemm", "config": label, "case": name, "offered": offered,
               "precise_kernel": precise_kernel, "gemm": case.gemm}
        started = time.perf_counter()
        try:
            if precise_kernel == "gluon" and GLUON_GEMM_KERNEL_NAME is None:
                raise RuntimeError(gluon_error)
            with CompileRecorder() as rec:
                G.fp8_gemm_triton(a, b, sa, sb, out_dtype=out_dtype, out=out, accumulate=case.accumulate,
                                  config=config, fast_accum=fast, precise_kernel=precise_kernel,
                                  layouts=mode.operand_layouts)
            (fn_name, kernel), = [k for k in rec.kernels if k[0] in (G.GEMM_KERNEL_NAME, GLUON_GEMM_KERNEL_NAME)]
            row.update(_describe(kernel, ptxas))
        except Exception as err:
            row["error"] = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        row["seconds"] = round(time.perf_counter() - started, 2)
        spills = row.get("spill_store_bytes") or row.get("spill_load_bytes")
        if spills and known_spill(case):
            row["known_spill"] = known_spill(case)
        rows.append(row)
        if offered and ("error" in row or (spills and "known_spill" not in row)):
            failures.append(f"gemm {label} {name}: {row.get('error') or 'spills'}")
        elif (fast or precise_kernel == "gluon") and ptxas and not (row.get("sass_wait_in_flight")
                                                                   and not row.get("wgmma_serialized")):
            failures.append(f"gemm {label} {name}: no wgmma group in flight in the SASS mainloop")

    # The other families continue the case numbering, so shards (gpu_check.sh's parallel precompile) share them too.
    first = gemm_count
    rows += quantize_rows(ptxas, failures, mine, first)
    first += len(list(quantize_cases()))
    rows += norm_quantize_rows(ptxas, failures, mine, first)
    first += len(list(norm_quantize_cases()))
    rows += optimizer_rows(ptxas, failures, mine, first, quick)
    first += len(list(optimizer_cases(quick)))
    rows += training_rows(ptxas, failures, mine, first, quick)
    first += len(list(training_cases(quick)))
    rows += attention_rows(ptxas, failures, mine, first, quick)
    first += len(list(attention_cases(quick)))
    rows += grouped_gemm_rows(ptxas, failures, mine, first)
    return rows, failures


def known_spill(case: GemmCase) -> str | None:
    """Why this GEMM case may spill without failing the audit, or None (then a spill is a regression).

    The one known spill: the Triton kernel accumulating wgrad into an fp32 C whose row stride N is not a multiple of
    16 elements (each C element gets its own 64-bit address beside two 64-register accumulator tiles: 4-436 B over
    the offered configs, Triton 3.6 and 3.9). No training shape has such an N (tests/test_gpu_check_shapes.py checks
    bench_train's and the GPU examples' GEMMs), and tests/test_kernel_audit.py holds it as a strict xfail, which
    fails the day it is fixed, so this rule is then removed."""
    if case.precise_kernel == "triton" and case.gemm == "wgrad" and case.accumulate and case.shape[1] % 16:
        return "wgrad into fp32 at N % 16 != 0: no training shape"
    return None


def case_families(quick: bool) -> list[str]:
    """The family of every audit case in audit order (the shard plan's unit of cost): "gemm triton", "gemm gluon",
    "quantize", "norm_quantize", "optimizer", "training gemm", "training cast", "attention",
    "grouped gemm" (audit_shards.FAMILY_SECONDS)."""
    families = [f"gemm {case.precise_kernel}" for case in gemm_cases(quick)]
    families += ["quantize"] * len(list(quantize_cases()))
    families += ["norm_quantize"] * len(list(norm_quantize_cases()))
    families += ["optimizer"] * len(list(optimizer_cases(quick)))
    families += [f"training {family}" for _, family, _ in training_cases(quick)]
    families += ["attention"] * len(list(attention_cases(quick)))
    families += ["grouped gemm"] * (len(GROUPED_GEMM_CASES) + len(GROUPED_WGRAD_CASES))
    return families


def training_cases(quick: bool):
    """(label, family, call) per kernel variant training launches, compiled at every shape of audit_training_shapes
    (bench_train's ~1B model and the 8B examples) at once: the call returns [(shape label, kernel name, kernel)] for
    every compile. The GEMMs in the default config (what training launches: no autotuning) on the Triton kernel, each
    fprop/dgrad/wgrad variant gemm_cases audits; the casts with stats (the guard's telemetry: on by default), with and
    without the transposed copy, E4M3 and E5M2; the fused RMSNorm/SwiGLU casts with x^T and stats. --quick: GEMMs only."""
    import torch

    from audit_training_shapes import TRAINING_SHAPES
    from megafp8_kernels import gemm as G
    from megafp8_kernels import quantize_triton as Q
    from megafp8_kernels.norm_quantize_triton import rmsnorm_quantize_triton, swiglu_quantize_triton

    variants = {case._replace(shape=(0, 0, 0)): None for case in gemm_cases(quick=True)
                if case.precise_kernel == "triton" and case.config is G.SM90_DEFAULT_CONFIG}
    for variant in variants:
        def gemm_call(v=variant):
            compiled = []
            for model in TRAINING_SHAPES:
                for M, N, K in model.gemms()[v.gemm]:
                    a, b = torch.empty(M, K, dtype=_fp8_dtype(v.a_dtype)), torch.empty(N, K, dtype=torch.float8_e4m3fn)
                    sa, sb = _scales(v.mode, M, N, K)
                    out_dtype = torch.float32 if v.out_dtype == "fp32" else torch.bfloat16
                    with CompileRecorder() as rec:
                        G.fp8_gemm_triton(a, b, sa, sb, out_dtype=out_dtype, accumulate=v.accumulate,
                                          out=torch.empty(M, N, dtype=out_dtype) if v.accumulate else None,
                                          config=G.SM90_DEFAULT_CONFIG, fast_accum=v.fast, precise_kernel="triton",
                                          layouts=v.mode.operand_layouts)
                    compiled += [(f"{v._replace(shape=(M, N, K)).name} {model.name}", *k) for k in rec.kernels
                                 if k[0] == G.GEMM_KERNEL_NAME]
            return compiled
        yield variant.name.replace(" 0x0x0", ""), "gemm", gemm_call
    if quick:
        return
    cast_shapes = sorted({(model.name, shape) for model in TRAINING_SHAPES for shape in model.cast_shapes()})
    for case, kwargs in quantize_cases():
        if not kwargs["stats"]:
            continue
        def cast_call(kwargs=kwargs, case=case):
            compiled = []
            for model, (rows, cols) in cast_shapes:
                with CompileRecorder() as rec:
                    Q.quantize_triton(torch.empty(rows, cols, dtype=torch.bfloat16), **kwargs)
                compiled += [(f"{case} {rows}x{cols} {model}", *k) for k in rec.kernels]
            return compiled
        yield case, "cast", cast_call
    for gran, scale in (("tensorwise", torch.ones(())), ("block_1x128", None)):
        what = "given scale" if scale is not None else gran
        def fused_call(gran=gran, scale=scale, what=what):
            compiled = []
            for model in TRAINING_SHAPES:
                x = torch.empty(model.tokens, model.hidden, dtype=torch.bfloat16)
                gate_up = torch.empty(model.tokens, 2 * model.ffn // model.tp, dtype=torch.bfloat16)
                kw = dict(scale=scale, transpose=True, stats=True)
                with CompileRecorder() as rec:
                    rmsnorm_quantize_triton(x, torch.ones(model.hidden, dtype=torch.bfloat16), 1e-5,
                                            torch.float8_e4m3fn, gran, **kw)
                    swiglu_quantize_triton(gate_up, None, torch.float8_e4m3fn, gran, **kw)
                shape = f"{model.tokens}x{model.hidden}/{2 * model.ffn // model.tp}"
                compiled += [(f"{what} transpose stats {shape} {model.name}", *k) for k in rec.kernels]
            return compiled
        yield f"fused {what} transpose stats", "cast", fused_call


def training_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool], first: int,
                  quick: bool) -> list[dict]:
    """One row per distinct compiled kernel of training_cases (shapes that specialize alike share one), marked
    "training": any spill or compile error fails, known_spill does not apply."""
    rows = []
    for index, (label, family, call) in enumerate(training_cases(quick), first):
        if not mine(index):
            continue
        started = time.perf_counter()
        try:
            compiled = call()
        except Exception as err:
            error = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
            rows.append({"kernel": family, "config": "training", "case": label, "offered": True, "training": True,
                         "error": error})
            failures.append(f"training {label}: {error}")
            continue
        seen = {}
        for shape_label, fn_name, kernel in compiled:
            if kernel.hash in seen:
                seen[kernel.hash]["shapes"] += 1
                continue
            config = f"w{kernel.metadata.num_warps} training"
            if fn_name == "_fp8_gemm_kernel":
                from megafp8_kernels import gemm as G

                c = G.SM90_DEFAULT_CONFIG
                config = f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps} " \
                         f"s{c.num_stages} (default) training"
            row = {"kernel": "fp8_gemm" if fn_name == "_fp8_gemm_kernel" else fn_name, "config": config,
                   "case": shape_label, "offered": True, "training": True, "variant": label, "shapes": 1,
                   **_describe(kernel, ptxas)}
            if fn_name == "_fp8_gemm_kernel":  # the GEMM rows' fields (training's precise kernel: the Triton one)
                row.update(precise_kernel="triton",
                           gemm=next((g for g in ("dgrad", "wgrad") if f" {g} " in f" {label} "), "fprop"))
            seen[kernel.hash] = row
            rows.append(row)
            if row.get("spill_store_bytes") or row.get("spill_load_bytes"):
                failures.append(f"training {fn_name} {shape_label}: spills")
            if "fast-accum" in shape_label and ptxas and not (row.get("sass_wait_in_flight")
                                                              and not row.get("wgmma_serialized")):
                failures.append(f"training {shape_label}: no wgmma group in flight in the SASS mainloop")
        for row in seen.values():
            row["seconds"] = round((time.perf_counter() - started) / len(seen), 2)
    return rows


def quantize_cases():
    """(case label, quantize_triton kwargs) of every quantize specialization: each granularity, and the given
    (delayed) scale, with and without the transposed copy and the stats counts, in E4M3 (activations, weights) and
    E5M2 (the hybrid format's gradients, labelled "e5m2": other constants, so other code)."""
    import torch

    for dtype in ("e4m3", "e5m2"):
        for gran in ("tensorwise", "rowwise", "block_1x128", "block_128x128", "given scale"):
            for transpose in (False, True):
                for stats in (False, True):
                    kwargs = dict(fp8_dtype=_fp8_dtype(dtype), granularity_=gran, transpose=transpose, stats=stats)
                    if gran == "given scale":
                        kwargs.update(granularity_="tensorwise", scale=torch.ones(()))
                    label = f"{gran}{' transpose' if transpose else ''}{' stats' if stats else ''}"
                    yield label + (" e5m2" if dtype == "e5m2" else ""), kwargs


def quantize_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool] = lambda index: True,
                  first: int = 0) -> list[dict]:
    """One row per distinct compiled quantize kernel (the amax kernel is shared by several casts: it is
    listed under the first), labelled with its launch: warps, tiles per program, rows held at once. Case i is
    audited when mine(first + i)."""
    import torch

    from megafp8_kernels import quantize_triton as Q

    x = torch.randn(256, 384).to(torch.bfloat16)
    rows, seen = [], set()
    for index, (case, kwargs) in enumerate(quantize_cases(), first):
        if not mine(index):
            continue
        started = time.perf_counter()
        with CompileRecorder() as rec:
            Q.quantize_triton(x, **kwargs)
        for fn_name, kernel in rec.kernels:
            if (fn_name, kernel.hash) in seen:
                continue
            seen.add((fn_name, kernel.hash))
            held = Q.SLAB_TRANSPOSED if kwargs["transpose"] else Q.SLAB
            held = f"{held}x{Q.TILE} slabs" if fn_name == "_cast_tile_kernel" else f"{Q.TILE}x{Q.TILE} tiles"
            row = {"kernel": fn_name, "config": f"w{kernel.metadata.num_warps} {Q.TILES_PER_PROGRAM} tiles/program "
                   f"{held}", "case": case, "offered": True, **_describe(kernel, ptxas),
                   "seconds": round(time.perf_counter() - started, 2)}
            started = time.perf_counter()  # a second kernel of the same cast: its own ptxas time
            rows.append(row)
            if row.get("spill_store_bytes") or row.get("spill_load_bytes"):
                failures.append(f"{fn_name} {case}: spills")
    return rows


NORM_QUANTIZE_KERNELS = ("_rmsnorm_quantize_kernel", "_swiglu_quantize_kernel")


def norm_quantize_cases():
    """(case label, kernel name, call) of every fused prologue cast (norm_quantize_triton.py) on bf16 activations: the
    recipes it fuses (a given scale, i.e. delayed scaling, and 1x128 blocks), with the transposed copy (training) and
    without (a forward under no_grad, e.g. validation), with and without the saturated/flushed counts (stats: on in
    every default FP8 run, the saturation guard's telemetry), and SwiGLU with Smooth-SwiGLU's channel scales. The
    norm weight is bf16 as under --bf16 (model_setup.py's params_dtype); an fp32 one (fp32 parameters, bf16
    activations) rounds the output to fp32 instead, other code: audited with x^T + stats ("fp32 weight")."""
    import torch

    from megafp8_kernels.norm_quantize_triton import rmsnorm_quantize_triton, swiglu_quantize_triton

    x = torch.randn(256, 384).to(torch.bfloat16)
    gate_up, channel_scale = torch.randn(256, 768).to(torch.bfloat16), torch.ones(384)
    for gran, scale in (("tensorwise", torch.ones(())), ("block_1x128", None)):
        for transpose in (True, False):
            for stats in (False, True):
                kw = dict(scale=scale, transpose=transpose, stats=stats)
                label = f"{'given scale' if scale is not None else gran}{' transpose' if transpose else ''}" \
                        f"{' stats' if stats else ''}"
                weights = [(torch.bfloat16, "")]
                if transpose and stats:
                    weights.append((torch.float32, " fp32 weight"))
                for dtype, what in weights:
                    yield label + what, "_rmsnorm_quantize_kernel", \
                        lambda kw=kw, gran=gran, w=torch.ones(384, dtype=dtype): \
                        rmsnorm_quantize_triton(x, w, 1e-5, torch.float8_e4m3fn, gran, **kw)
                for s, what in ((None, ""), (channel_scale, " smooth-swiglu")):
                    yield label + what, "_swiglu_quantize_kernel", \
                        lambda kw=kw, gran=gran, s=s: \
                        swiglu_quantize_triton(gate_up, s, torch.float8_e4m3fn, gran, **kw)


def norm_quantize_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool] = lambda index: True,
                       first: int = 0) -> list[dict]:
    """One row per fused prologue cast (norm_quantize_cases), labelled with its warps and the rows a program holds."""
    from megafp8_kernels import norm_quantize_triton as NQ

    def launch(case: str, kernel) -> str:
        held = NQ.GIVEN_SCALE_ROWS if case.startswith("given scale") else NQ.TILE
        return f"w{kernel.metadata.num_warps if kernel else 8} {held}x{NQ.TILE} tiles"

    return compiled_case_rows(norm_quantize_cases(), launch, ptxas, failures, mine, first)


ATTENTION_KERNELS = ("_fp8_attention_forward_kernel", "_fp8_attention_dkdv_kernel", "_fp8_attention_dq_kernel")


def attention_cases(quick: bool = False):
    """(case label, kernel name, call) of the FP8 attention kernels (fp8_attention_triton.py): forward, dK/dV and dQ at
    head dims 64 and 128 (quick: 128, the register-heavier), causal (the diagonal block, CP=1) and not (a ring
    block), GQA 8 query heads on 2 K/V heads, dS in E5M2 (hybrid)."""
    import torch

    from megafp8_kernels import element_format
    from megafp8_kernels.fp8_attention_triton import fp8_attention_backward_triton, fp8_attention_forward_triton

    e5m2 = element_format(torch.float8_e5m2)
    for d in (128,) if quick else (64, 128):
        q = torch.zeros(1, 8, 256, d, dtype=torch.float8_e4m3fn)
        kv = torch.zeros(1, 2, 256, d, dtype=torch.float8_e4m3fn)
        do = torch.zeros(1, 8, 256, d, dtype=torch.float8_e5m2)
        one, rows = torch.ones(()), torch.zeros(1, 8, 256)
        for causal in (True, False):
            label = f"d{d} {'causal' if causal else 'full'} gqa"
            yield label, ATTENTION_KERNELS[0], lambda q=q, kv=kv, one=one, causal=causal: \
                fp8_attention_forward_triton(q, kv, kv, one, one, one, causal, 0.125)
            backward = lambda q=q, kv=kv, do=do, one=one, rows=rows, causal=causal: \
                fp8_attention_backward_triton(do, q, kv, kv, one, one, one, one, rows, rows, causal, 0.125, e5m2)
            yield label, ATTENTION_KERNELS[1], backward
            yield label, ATTENTION_KERNELS[2], backward


def grouped_gemm_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool] = lambda index: True,
                      first: int = 0) -> list[dict]:
    """One row per grouped FP8 GEMM case, labelled with its Hopper tile."""
    from megafp8_kernels.grouped_gemm_triton import SM90_CONFIG as c

    def launch(case: str, kernel) -> str:
        return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"

    return compiled_case_rows([*grouped_gemm_cases(), *grouped_wgrad_cases()], launch, ptxas, failures, mine, first)


def attention_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool] = lambda index: True,
                   first: int = 0, quick: bool = False) -> list[dict]:
    """One row per FP8 attention kernel specialization, labelled with its warps and tile."""
    from megafp8_kernels import fp8_attention_triton as A

    def launch(case: str, kernel) -> str:
        return f"w{kernel.metadata.num_warps if kernel else A.WARPS} {A.BLOCK_M}x{A.BLOCK_N}"

    return compiled_case_rows(attention_cases(quick), launch, ptxas, failures, mine, first)


def optimizer_rows(ptxas: str | None, failures: list[str], mine: Callable[[int], bool] = lambda index: True,
                   first: int = 0, quick: bool = False) -> list[dict]:
    """One row per fused optimizer kernel specialization (audit_optimizer_cases.py), with CUDA's launch sizes."""
    from audit_optimizer_cases import gpu_launch_sizes

    def launch(case: str, kernel) -> str:
        return f"w{kernel.metadata.num_warps}" if kernel else ""

    with gpu_launch_sizes():
        return compiled_case_rows(optimizer_cases(quick), launch, ptxas, failures, mine, first)


def compiled_case_rows(cases, launch: Callable[[str, object], str], ptxas: str | None, failures: list[str],
                       mine: Callable[[int], bool], first: int) -> list[dict]:
    """One row per (label, kernel name, call) case whose index is mine: the call compiles exactly one kernel of that
    name; any spill or compile error is a failure."""
    rows = []
    for index, (case, kernel_name, call) in enumerate(cases, first):
        if not mine(index):
            continue
        row = {"kernel": kernel_name, "config": launch(case, None), "case": case, "offered": True}
        started = time.perf_counter()
        try:
            with CompileRecorder() as rec:
                call()
            (_, kernel), = [k for k in rec.kernels if k[0] == kernel_name]
            row.update(config=launch(case, kernel), **_describe(kernel, ptxas))
        except Exception as err:  # e.g. an API another Triton release lacks: its row fails, the others still run
            row["error"] = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows.append(row)
        if "error" in row or row.get("spill_store_bytes") or row.get("spill_load_bytes"):
            failures.append(f"{kernel_name} {case}: {row.get('error') or 'spills'}")
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
        spills = f"{r.get('spill_store_bytes')}/{r.get('spill_load_bytes')}"
        if "known_spill" in r:
            spills += f" (known: {r['known_spill']})"
        lines.append(f"| {r['kernel']} | {config} | {r['case']} | {r.get('registers')} | "
                     f"{spills} | {r['shared_bytes'] / 1024:.0f} | "
                     f"{wait} | {flight} | {'yes' if r['tma_loads'] else 'no'} |")
    return "\n".join(lines)


def compare_markdown(reports: list[dict]) -> str:
    """One table of several --json reports (e.g. Triton 3.9.0 and 3.6.0): registers, spill bytes (st/ld) and the SASS
    "wgmma in flight" column (with the FP ops under the wait) per Triton version, rows matched by kernel, config and
    case."""
    versions = [report.get("triton", "?") for report in reports]
    head = " | ".join(f"registers {v} | spills {v}" for v in versions)
    flight = " / ".join(versions)
    lines = [f"| kernel | config | case | {head} | shared KB | wgmma in flight (FP ops under it; {flight}) |",
             "|---|---|---|" + "---|---|" * len(versions) + "---|---|"]
    keyed = [{(r["kernel"], r["config"], r["case"]): r for r in report["rows"]} for report in reports]
    order = list(dict.fromkeys(key for rows in keyed for key in rows))
    for key in order:
        cells, shared, flights = [], "", []
        for rows in keyed:
            r = rows.get(key)
            if r is None or "error" in r:
                cells.append(f"{'failed' if r else 'not audited'} | ")
                flights.append("-")
                continue
            cells.append(f"{r.get('registers')} | {r.get('spill_store_bytes')}/{r.get('spill_load_bytes')}")
            shared = f"{r['shared_bytes'] / 1024:.0f}"
            state = {None: "-", False: "no", True: "yes"}[r.get("sass_wait_in_flight") if r["wgmma"] else None]
            flights.append(f"{state} ({r['sass_math_under_wait']})" if state == "yes" else state)
        offered = all(rows[key].get("offered", True) for rows in keyed if key in rows)
        config = key[1] + ("" if offered else " (not offered)")
        lines.append(f"| {key[0]} | {config} | {key[2]} | {' | '.join(cells)} | {shared} | {' / '.join(flights)} |")
    return "\n".join(lines)


SIDE_VENV_SCRIPT = Path(__file__).resolve().with_name("triton_side_venv.sh")
REGISTRY_UNREACHABLE = 3  # triton_side_venv.sh's exit code when the Triton wheel cannot be downloaded


def under_triton(version: str, script: str, argv: list[str]) -> int | None:
    """None when the imported Triton is `version`; else runs `script argv` with the python of a side venv holding
    that Triton (triton_side_venv.sh creates it once, from PyPI, beside .venv) and returns its exit code, or
    REGISTRY_UNREACHABLE when the venv cannot be made because the wheel cannot be downloaded."""
    import triton

    if triton.__version__ == version:
        return None
    made = subprocess.run(["bash", str(SIDE_VENV_SCRIPT), "--version", version, "--python", sys.executable],
                          stdout=subprocess.PIPE, text=True)
    if made.returncode != 0:
        print(f"kernel_audit: no side venv with triton=={version} (triton_side_venv.sh exit {made.returncode})",
              file=sys.stderr)
        return REGISTRY_UNREACHABLE if made.returncode == REGISTRY_UNREACHABLE else 1
    python = made.stdout.strip().splitlines()[-1]
    return subprocess.run([python, script, *argv]).returncode


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (ptxas, nvdisasm): what one dedicated
    core would take, whatever else shares the machine."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GEMMs: the default config and the Gluon kernel only")
    parser.add_argument("--shard", default="0/1", help="I/N: audit every N-th case from the I-th (parallel precompiles)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="print one table of these --json reports "
                        "(registers and spills per Triton version) and exit")
    parser.add_argument("--triton", metavar="VERSION", help="audit under this Triton release (e.g. 3.6.0, the GPU "
                        "image's) from a side venv made by triton_side_venv.sh when the installed one differs")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare_markdown([json.loads(Path(path).read_text()) for path in args.compare]))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the audit compiles real kernels; unset it")
    if args.triton:
        code = under_triton(args.triton, __file__, sys.argv[1:] if argv is None else argv)
        if code is not None:
            return code
    if ptxas_path() is None:
        print("kernel_audit: the Triton wheel has no ptxas for sm_90a; cannot audit", file=sys.stderr)
        return 2
    try:
        index, count = (int(part) for part in args.shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        parser.error(f"--shard {args.shard!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    rows, failures = audit(args.quick, shard=(index, count))
    known = [f"{r['kernel']} {r['config']} {r['case']}: {r['known_spill']}" for r in rows if "known_spill" in r]
    table = markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "shard": args.shard, "rows": rows,
                                               "failures": failures, "known_spills": known,
                                               "wall_seconds": round(time.perf_counter() - _STARTED, 1),
                                               "cpu_seconds": round(_cpu_seconds(), 1)}, indent=1))
    for spill in known:
        print(f"KNOWN {spill}")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
