"""Triton FP8 GEMM: C = (A * scale_a) @ (B * scale_b).T with fp32 accumulation.

Twin: gemm_reference.py. A (M, K) and B (N, K) are both K-major, the layout Hopper's FP8 tensor-core
instructions want. Scale modes (scaling.GemmScaleMode):
  tensorwise / rowwise  acc = sum over 128-wide K steps of A.B (each step promoted to fp32), then
                        acc * sa[m] * sb[n] in the epilogue;
  blockwise             each 128-wide K step's partial product is scaled by its own sa[m, k] * sb[n(/128), k]
                        before it joins the fp32 accumulator (DeepSeek-V3's promotion of partial sums).
The epilogue adds the bias and, for wgrad across micro-batches, the existing contents of C.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .quantize_triton import _interpreting
from .scaling import BLOCK, GemmScaleMode, check_gemm_args

_MODE = {
    GemmScaleMode.TENSORWISE: 0,
    GemmScaleMode.ROWWISE: 1,
    GemmScaleMode.BLOCKWISE: 2,
    GemmScaleMode.BLOCKWISE_1X128: 3,
}


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_sa_m, stride_sa_k, stride_sb_n, stride_sb_k,
                     SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M row-blocks share each B column-block while it is hot in L2.
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * grid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # int64: offsets may exceed 2**31
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) view of K-major B

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k_step * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE_MODE >= 2:
            # BLOCK_K == 128: this step is exactly one scale group along K. The quantizer stores 1x128
            # scales K-block-major (stride_sa_m == 1), so this is one contiguous vector load per step;
            # any other strides (e.g. row-major scales gathered over sequence parallelism) still work.
            sa = tl.load(sa_ptr + offs_m * stride_sa_m + k_step * stride_sa_k, mask=m_ok, other=0.0)
            if SCALE_MODE == 2:
                sb = tl.load(sb_ptr + (offs_n // 128) * stride_sb_n + k_step * stride_sb_k, mask=n_ok, other=0.0)
            else:
                sb = tl.load(sb_ptr + offs_n * stride_sb_n + k_step * stride_sb_k, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            # A fresh dot per K step added into fp32: Hopper's FP8 tensor cores accumulate with ~14
            # bits internally, and Triton's default lets a dot over all of K stay there (DeepSeek-V3
            # measured ~2% error at K=4096). Promoting every BLOCK_K keeps accumulation in fp32.
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # ---- epilogue ----
    if SCALE_MODE == 0:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    elif SCALE_MODE == 1:
        sa = tl.load(sa_ptr + offs_m * stride_sa_m, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + offs_n * stride_sb_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    c_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _config(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_stages=stages, num_warps=warps)


# Register budget on Hopper (reasoned, not yet measured: tools/bench/gpu_check.sh prints n_regs/n_spills).
# A wgmma accumulator lives in the registers of the warps that issue it: BLOCK_M * BLOCK_N fp32 values
# over 32 * num_warps threads. The per-K-step promotion above keeps TWO such tiles live (the running
# fp32 `acc` and the fresh `tl.dot` result; Triton's own max_num_imprecise_acc lowering does the same),
# and a thread has at most 255 registers, of which ~60-90 go to addresses, masks, scale vectors and
# loop state:
#   128x128, 8 warps: 128*128 / 256 =  64 per tile, 128 for two   -> fits
#    64x128 or 128x64, 4 warps:        64 per tile, 128 for two   -> fits
#   128x128, 4 warps:                 128 per tile, 256 for two   -> spills
#   128x256 or 256x128, 8 warps:      128 per tile, 256 for two   -> spills
# so the spilling shapes are not offered at all. Shared memory per pipeline stage is
# (BLOCK_M + BLOCK_N) * BLOCK_K FP8 bytes: 32 KB at 128x128, so 4 stages use 128 of Hopper's 227 KB.
# BLOCK_K is 128 everywhere so blockwise scaling has exactly one scale group per K step.
SM90_DEFAULT_CONFIG = _config(128, 128, 128, 4, 8)
_SM90_CONFIGS = [
    SM90_DEFAULT_CONFIG,
    _config(128, 128, 128, 3, 8),
    _config(64, 128, 128, 4, 4),
    _config(128, 64, 128, 4, 4),
]
# Other GPUs with FP8 dots (Ada, sm_89: mma.sync, ~99 KB shared memory per block): smaller tiles.
# 128x64 at 4 warps holds 64 + 64 accumulator registers and 3 x 24 KB of stages.
FALLBACK_DEFAULT_CONFIG = _config(128, 64, 128, 3, 4)
_FALLBACK_CONFIGS = [
    FALLBACK_DEFAULT_CONFIG,
    _config(64, 64, 128, 4, 4),
    _config(128, 128, 128, 3, 8),
]
# Shapes the budget above rules out; kept only so gpu_check.sh can confirm the reasoning (n_spills).
SM90_REJECTED_CONFIGS = [
    _config(128, 256, 128, 3, 8),
    _config(256, 128, 128, 3, 8),
    _config(128, 128, 128, 3, 4),
]
AUTOTUNE_ENV_VAR = "MEGAFP8_GEMM_AUTOTUNE"  # "0": the default (non-spilling) config, no tuning sweep
_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": BLOCK, "GROUP_M": 2}


@functools.lru_cache(maxsize=None)
def _autotuned_kernel(hopper: bool):
    return triton.autotune(
        configs=_SM90_CONFIGS if hopper else _FALLBACK_CONFIGS,
        key=["M", "N", "K", "SCALE_MODE", "ACCUMULATE"],
        restore_value=["c_ptr"],  # tuning runs the kernel many times; accumulate must see C once
    )(_fp8_gemm_kernel)


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
    config: triton.Config | None = None,
):
    """Triton twin of `fp8_gemm_reference` (same arguments). `config` forces one launch config and
    then returns (out, Triton's compiled kernel) so tools can read its n_regs / n_spills."""
    mode = check_gemm_args(a, b, scale_a, scale_b, out_dtype, bias, out, accumulate)
    a, b = a.contiguous(), b.contiguous()
    (M, K), N = a.shape, b.shape[0]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    elif not out.is_contiguous():
        raise ValueError("fp8_gemm's `out` must be contiguous")
    args = (a, b, out, bias if bias is not None else out, scale_a, scale_b, M, N, K,
            a.stride(0), b.stride(0), out.stride(0), *_scale_strides(scale_a), *_scale_strides(scale_b))
    meta = dict(SCALE_MODE=_MODE[mode], HAS_BIAS=bias is not None, ACCUMULATE=accumulate)
    if config is not None:
        return out, _launch(args, meta, config)
    if _interpreting():
        grid = (triton.cdiv(M, 32) * triton.cdiv(N, 32),)
        _fp8_gemm_kernel[grid](*args, **meta, **_INTERPRETER_CONFIG)
        return out
    hopper = torch.cuda.get_device_capability(a.device)[0] == 9
    if os.environ.get(AUTOTUNE_ENV_VAR, "1") == "0":
        # One fixed, non-spilling config per specialization instead of a tuning sweep (tests, first runs).
        _launch(args, meta, SM90_DEFAULT_CONFIG if hopper else FALLBACK_DEFAULT_CONFIG)
        return out
    grid = lambda cfg: (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)  # noqa: E731
    _autotuned_kernel(hopper)[grid](*args, **meta)
    return out


def _scale_strides(scale: torch.Tensor) -> tuple[int, int]:
    """(stride along rows, stride along K groups) of a scale tensor; 0 for a one-element scale."""
    if scale.numel() == 1:
        return 0, 0
    return scale.stride(0), scale.stride(1)


def _launch(args: tuple, meta: dict, config: triton.Config):
    M, N = args[6], args[7]
    grid = (triton.cdiv(M, config.kwargs["BLOCK_M"]) * triton.cdiv(N, config.kwargs["BLOCK_N"]),)
    return _fp8_gemm_kernel[grid](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                  num_stages=config.num_stages)
