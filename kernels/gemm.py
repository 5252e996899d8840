"""Triton FP8 GEMM: C = (A * scale_a) @ (B * scale_b).T with fp32 accumulation.

Twin: gemm_reference.py. A (M, K) and B (N, K) are both K-major, the layout Hopper's FP8 tensor-core
instructions want. Scale modes (scaling.GemmScaleMode, from the caller's declared layouts):
  tensorwise / rowwise  acc = sum over 128-wide K steps of A.B (each step promoted to fp32), then
                        acc * sa[m] * sb[n] in the epilogue;
  blockwise             each 128-wide K step's partial product is scaled by its own sa[m, k] * sb[n(/128), k]
                        before it joins the fp32 accumulator (DeepSeek-V3's promotion of partial sums).
The epilogue adds the bias and, for wgrad across micro-batches, the existing contents of C.
`fast_accum` (tensorwise/rowwise, for fprop as TransformerEngine does) lets the tensor core accumulate over
all of K instead of promoting every 128.

Hopper shape of the kernel: A and B arrive by TMA (host tensor descriptors; K padded to a multiple of 16
when TMA's 16-byte stride rule needs it), a persistent grid of one program per SM walks the tiles in
grouped order, and Triton pipelines the loads over num_stages. tools/bench/kernel_audit.py checks the
sm_90a compile offline (registers, spills, wgmma.wait_group, cp.async.bulk.tensor, SASS waits).
The precise path here waits for each K step's wgmma before promoting it (Triton's pipeliner only keeps a
dot in flight when its result feeds the next dot); gemm_hopper.py's Gluon kernel, same arguments and
promotion, keeps the next step's wgmma in flight during it (MEGAFP8_GEMM_PRECISE_KERNEL=gluon, Hopper).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from .formats import ScaleLayout
from .quantize_triton import _interpreting
from .scaling import BLOCK, GemmScaleMode, check_gemm_args

_MODE = {
    GemmScaleMode.TENSORWISE: 0,
    GemmScaleMode.ROWWISE: 1,
    GemmScaleMode.BLOCKWISE: 2,
    GemmScaleMode.BLOCKWISE_1X128: 3,
}


GEMM_KERNEL_NAME = "_fp8_gemm_kernel"


@triton.jit
def _fp8_gemm_kernel(a_desc, b_desc, c_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, K,
                     stride_cm, stride_sa_m, stride_sa_k, stride_sb_n, stride_sb_k,
                     SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                     FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    # Persistent: one program per SM walks the output tiles in grouped order (GROUP_M row-blocks share
    # each B column-block while it is hot in L2). A and B come in by TMA (host tensor descriptors).
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    num_tiles = grid_m * grid_n
    k_steps = tl.cdiv(K, BLOCK_K)
    group_size = GROUP_M * grid_n
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        first_m = (tile // group_size) * GROUP_M
        rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group_size) % rows_in_group
        pid_n = (tile % group_size) // rows_in_group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # int64: offsets may exceed 2**31
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        m_ok, n_ok = offs_m < M, offs_n < N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FAST_ACCUM:
            # fprop only (TransformerEngine's choice): the tensor core's own accumulator over all of K.
            # The dot chains into `acc`, so Triton keeps one wgmma group in flight (wait_group 1).
            for k_step in tl.range(0, k_steps):
                a = a_desc.load([pid_m * BLOCK_M, k_step * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, k_step * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
        else:
            # Precise: each 128-wide K step is a fresh dot promoted into the fp32 `acc` (Hopper's FP8 tensor
            # cores keep ~14 bits; DeepSeek-V3 measured ~2% error at K=4096 without promotion). Blockwise
            # modes scale each step's partial product by that K group's scales before it joins `acc`.
            for k_step in tl.range(0, k_steps):
                a = a_desc.load([pid_m * BLOCK_M, k_step * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, k_step * BLOCK_K])
                partial = tl.dot(a, b.T)
                if SCALE_MODE >= 2:
                    # BLOCK_K == 128: one scale group per step. 1x128 scales are stored K-block-major
                    # (stride_sa_m == 1): one contiguous vector load per step; other strides still work.
                    sa = tl.load(sa_ptr + offs_m * stride_sa_m + k_step * stride_sa_k, mask=m_ok, other=0.0)
                    if SCALE_MODE == 2:
                        sb = tl.load(sb_ptr + (offs_n // 128) * stride_sb_n + k_step * stride_sb_k, mask=n_ok,
                                     other=0.0)
                    else:
                        sb = tl.load(sb_ptr + offs_n * stride_sb_n + k_step * stride_sb_k, mask=n_ok, other=0.0)
                    acc += partial * sa[:, None] * sb[None, :]
                else:
                    acc += partial

        _epilogue(acc, c_ptr, bias_ptr, sa_ptr, sb_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, stride_sa_m,
                  stride_sb_n, SCALE_MODE, HAS_BIAS, ACCUMULATE)


@triton.jit
def _epilogue(acc, c_ptr, bias_ptr, sa_ptr, sb_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, stride_sa_m, stride_sb_n,
              SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr):
    """Tensorwise/rowwise scales, bias, accumulate into C, masked store. Shared with gemm_hopper.py's Gluon
    kernel (a @triton.jit function called from Gluon takes the caller's layouts)."""
    if SCALE_MODE == 0:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    elif SCALE_MODE == 1:
        sa = tl.load(sa_ptr + offs_m * stride_sa_m, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + offs_n * stride_sb_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]  # int64: C may pass 2**31
    c_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _set_block_shapes(nargs: dict) -> None:
    """Autotuner pre-hook: the TMA descriptors' block shapes follow the config being tried."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _config(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_stages=stages,
                         num_warps=warps, pre_hook=_set_block_shapes)


# Register budget on Hopper, checked offline by tools/bench/kernel_audit.py (sm_90a compile + ptxas, no GPU;
# table in docs/kernels.md). A wgmma accumulator lives in the registers of the warps that issue it:
# BLOCK_M * BLOCK_N fp32 values over 32 * num_warps threads. The precise path keeps TWO such tiles live
# (the running fp32 `acc` and the fresh `tl.dot` result), and a thread has at most 255 registers:
#   128x128, 8 warps: 128*128 / 256 =  64 per tile, 128 for two   -> fits (175-233 registers measured)
#    64x128 or 128x64, 4 warps:        64 per tile, 128 for two   -> fits
#   128x128, 4 warps:                 128 per tile, 256 for two   -> spills
#   128x256 or 256x128, 8 warps:      128 per tile, 256 for two   -> spills
# Shared memory per pipeline stage is (BLOCK_M + BLOCK_N) * BLOCK_K FP8 bytes: 32 KB at 128x128. Four
# stages at 128x128 spill 40 bytes in the blockwise modes at sizes that are not multiples of 16 (less
# integer specialization, measured by the audit), three do not: the default uses 3 (128x64 likewise).
# BLOCK_K is 128 everywhere so blockwise scaling has exactly one scale group per K step.
SM90_DEFAULT_CONFIG = _config(128, 128, 128, 3, 8)
SM90_CONFIGS = [
    SM90_DEFAULT_CONFIG,
    _config(64, 128, 128, 4, 4),
    _config(128, 64, 128, 3, 4),  # 4 stages spilled 16 bytes tensorwise at 70x90x300 (the audit)
]
# Other GPUs with FP8 dots (Ada, sm_89: mma.sync, ~99 KB shared memory per block): smaller tiles.
# 128x64 at 4 warps holds 64 + 64 accumulator registers and 3 x 24 KB of stages.
FALLBACK_DEFAULT_CONFIG = _config(128, 64, 128, 3, 4)
_FALLBACK_CONFIGS = [
    FALLBACK_DEFAULT_CONFIG,
    _config(64, 64, 128, 4, 4),
    _config(128, 128, 128, 3, 8),
]
# Shapes the budget above rules out; kept only so the audit can confirm the reasoning.
SM90_REJECTED_CONFIGS = [
    _config(128, 128, 128, 4, 8),
    _config(128, 64, 128, 4, 4),
    _config(128, 256, 128, 3, 8),
    _config(256, 128, 128, 3, 8),
    _config(128, 128, 128, 3, 4),
]
# "1": tune over the offered configs (benchmarks, `--fp8-gemm-autotune`); unset or "0": the default, audited
# non-spilling config. Not tuning by default: every rank of a training job would tune on its own, could pick another
# config than its TP peers, and tunes (synchronizing its device) while NCCL work is in flight.
AUTOTUNE_ENV_VAR = "MEGAFP8_GEMM_AUTOTUNE"
# "gluon": the precise path (no fast_accum) runs gemm_hopper.py's kernel on Hopper, with one wgmma group in
# flight while the previous K step is promoted (SASS-checked offline by kernel_audit.py, not yet timed or
# checked on a GPU: opt-in until gpu_check.sh has compared it with the twin). Unset / "triton": this file's.
PRECISE_KERNEL_ENV_VAR = "MEGAFP8_GEMM_PRECISE_KERNEL"
# The Gluon kernel holds acc + two partials live. At 128x128 over 8 warps that is 3 x 64 registers and it
# spilled 8-72 bytes at odd sizes with a bias and accumulate (1x128 x 1x128 scales, 32 registers per set of
# column scales, spilled without them); 128x64 (3 x 32) fits every case: 186-208 registers, four stages to
# keep 96 KB of loads in flight (kernel_audit.py).
SM90_PROMOTED_CONFIG = _config(128, 64, 128, 4, 8)
_INTERPRETER_CONFIG = _config(32, 32, BLOCK, 1, 4, group=2)


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV_VAR, "0") == "1"


def tuning_cache_options() -> dict:
    """Keep tuning results in Triton's cache directory (TRITON_CACHE_DIR), so a second process with the same
    kernel and shapes reuses them instead of tuning again (Triton >= 3.2; older ones tune per process)."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


@functools.lru_cache(maxsize=None)
def _autotuned_kernel(hopper: bool):
    return triton.autotune(
        configs=SM90_CONFIGS if hopper else _FALLBACK_CONFIGS,
        key=["M", "N", "K", "SCALE_MODE", "ACCUMULATE", "FAST_ACCUM"],
        restore_value=["c_ptr"],  # tuning runs the kernel many times; accumulate must see C once
        **tuning_cache_options(),
    )(_fp8_gemm_kernel)


def default_config(hopper: bool) -> triton.Config | None:
    """The launch config when the caller gives none: the audited default, or None to tune (autotune_enabled)."""
    if _interpreting():
        return _INTERPRETER_CONFIG
    if autotune_enabled():
        return None
    return SM90_DEFAULT_CONFIG if hopper else FALLBACK_DEFAULT_CONFIG


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fp8_gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    fast_accum: bool = False,
    config: triton.Config | None = None,
    precise_kernel: str | None = None,
    layouts: tuple[ScaleLayout | str, ScaleLayout | str] | None = None,
):
    """Triton twin of `fp8_gemm_reference` (same arguments). `fast_accum` (tensorwise/rowwise only, meant for
    fprop) accumulates over all of K in the tensor core instead of promoting every 128. `config` forces one
    launch config and then returns (out, Triton's compiled kernel) so tools can read its resources.
    `precise_kernel` ("triton" or "gluon"; default from MEGAFP8_GEMM_PRECISE_KERNEL) picks the Hopper kernel
    of the precise path. `layouts`: the declared (A, B) scale layouts, as for the twin."""
    mode = check_gemm_args(a, b, scale_a, scale_b, out_dtype, bias, out, accumulate, layouts)
    if fast_accum and mode not in (GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE):
        raise ValueError(f"fast_accum=True is for tensorwise/rowwise GEMMs; {mode.value} promotes every 128 of K")
    (M, K), N = a.shape, b.shape[0]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    elif not out.is_contiguous():
        raise ValueError("fp8_gemm's `out` must be contiguous")
    a, b = _tma_ready(a), _tma_ready(b)
    # The kernels' arguments after the A/B descriptors (those depend on the kernel and its block shapes).
    operands = (out, bias if bias is not None else out, scale_a, scale_b, M, N, K,
                out.stride(0), *_scale_strides(scale_a), *_scale_strides(scale_b))
    meta = dict(SCALE_MODE=_MODE[mode], HAS_BIAS=bias is not None, ACCUMULATE=accumulate)
    if _use_promoted_kernel(a.device, fast_accum, precise_kernel):
        from . import gemm_hopper

        kernel = gemm_hopper.launch(a, b, operands, meta, config or SM90_PROMOTED_CONFIG, _num_programs(a.device))
        return (out, kernel) if config is not None else out
    meta["FAST_ACCUM"] = fast_accum
    if config is None:
        hopper = not _interpreting() and torch.cuda.get_device_capability(a.device)[0] == 9
        config = default_config(hopper)
        returns_kernel = False
    else:
        returns_kernel = True
    # Descriptors' block shapes depend on the config: with the autotuner they are rebuilt per config by a
    # pre-hook; with one config they are built here.
    blocks = config.kwargs if config is not None else {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": BLOCK}
    a_desc = TensorDescriptor.from_tensor(a, [blocks["BLOCK_M"], blocks["BLOCK_K"]])
    b_desc = TensorDescriptor.from_tensor(b, [blocks["BLOCK_N"], blocks["BLOCK_K"]])
    args = (a_desc, b_desc, *operands)
    if config is not None:
        kernel = _launch(args, meta, config, _num_programs(a.device))
        return (out, kernel) if returns_kernel else out
    programs = _num_programs(a.device)
    grid = lambda cfg: (min(programs, triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])),)  # noqa: E731
    _autotuned_kernel(hopper)[grid](*args, **meta)
    return out


def _use_promoted_kernel(device: torch.device, fast_accum: bool, precise_kernel: str | None) -> bool:
    """Whether the precise path runs gemm_hopper.py's Gluon kernel (Hopper or the offline audit only)."""
    choice = precise_kernel or os.environ.get(PRECISE_KERNEL_ENV_VAR) or "triton"
    if choice not in ("triton", "gluon"):
        raise ValueError(f"{PRECISE_KERNEL_ENV_VAR}={choice!r}: expected 'triton' or 'gluon'")
    if choice == "triton" or fast_accum or _interpreting():
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9  # CPU: compile-only audit


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x, contiguous, 16-byte aligned and with K padded by zeros to a multiple of 16 (TMA's stride rule). Zero
    columns add nothing to the product and never cross a 128-wide scale group, so the scales are unchanged."""
    x = x.contiguous()
    K = x.shape[1]
    if K % 16 == 0 and x.data_ptr() % 16 == 0:
        return x
    padded = torch.zeros((x.shape[0], triton.cdiv(K, 16) * 16), dtype=x.dtype, device=x.device)
    padded[:, :K] = x
    return padded


def _num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few in the interpreter, so the tile loop is exercised)."""
    if _interpreting() or device.type != "cuda":
        return 3 if _interpreting() else 132  # 132: H100/H200 SXM, for compile-only audits
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _scale_strides(scale: torch.Tensor) -> tuple[int, int]:
    """(stride along rows, stride along K groups) of a scale tensor; 0 for a one-element scale."""
    if scale.numel() == 1:
        return 0, 0
    return scale.stride(0), scale.stride(1)


def _launch(args: tuple, meta: dict, config: triton.Config, programs: int):
    M, N = args[6], args[7]
    tiles = triton.cdiv(M, config.kwargs["BLOCK_M"]) * triton.cdiv(N, config.kwargs["BLOCK_N"])
    return _fp8_gemm_kernel[(min(programs, tiles),)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                                     num_stages=config.num_stages)
