"""Triton twins of the fused prologue quantizers (norm_quantize_reference.py): RMSNorm / SwiGLU -> FP8.

One kernel per prologue reads the prologue's input and writes only the FP8 bytes (+ the transposed copy, the
scales, the amax) for the recipes whose scale is known inside a 128x128 tile: a given scale (delayed scaling)
and 1x128 blocks (the transposed copy's 128x1 groups are the tile's columns). Each program owns 128 rows (64 with a
given scale: GIVEN_SCALE_ROWS): RMSNorm first sums x^2 over the row's K chunks (x is read twice, from L2 the second
time), then normalizes, scales and casts chunk by chunk. Tensorwise and rowwise current scaling need an amax over
more than a tile before the cast: there the prologue runs as torch ops and the standalone quantizer casts it (two
passes, the same values).

Bits: the cast follows quantize_triton.py exactly; the prologue's own fp32 math (the row sum's order, rsqrt, exp)
may differ from torch's by an ulp, so an FP8 byte can differ where the value sits on a rounding boundary.
With stats=True the cast also counts saturated and flushed elements, as quantize_triton's: two int64 atomic adds
per tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_quantize_reference import rms_norm_forward_reference, swiglu_reference
from .quantize_triton import (
    TILE,
    _add_cast_counts,
    _interpreting,
    _nan_max,
    _reciprocal,
    _scale_from_amax,
    to_fp8_bits,
    quantize_triton,
    triton_fp8_dtype,
)
from .scaling import BLOCK, Fp8Quantized, Granularity, check_quantize_args, empty_scales, granularity

_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}  # fp16 activations take the two-pass path
# Rows per program (RMSNorm) or tile (SwiGLU) of the given-scale cast; 1x128 needs all 128, its transposed copy's
# groups being 128-row columns. One scale for the whole tensor lets a program hold fewer rows: at 128, RMSNorm with
# the transposed copy and stats (a delayed-scaling training step: the saturation guard turns stats on) took 255
# registers and spilled 48 B under Triton 3.6, the GPU image's (0 under 3.9); at 64 every given-scale variant takes
# 64-176 registers, spill-free under both (tools/bench/kernel_audit.py, docs/kernels.md). The cast is elementwise and
# the amax a max: the bits do not depend on it (rstd's row sum may change order within an ulp, as documented above).
GIVEN_SCALE_ROWS = 64


@triton.jit
def _round_to(y, DTYPE: tl.constexpr):
    """fp32 y rounded to DTYPE (fp32 or bf16) and back, round-to-nearest-even written out: the interpreter's
    bf16 conversion does not round to nearest even; on GPU this is what cvt.rn.bf16 gives."""
    if DTYPE == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        y = tl.where(y != y, y, rounded)
    return y


@triton.jit
def _cast_and_store(y, offs_m, offs_k, row_ok, col_ok, pid_m, pid_k, n_k_tiles, M, K, q_ptr, qt_ptr, amax_ptr,
                    scale_ptr, scale_inv_ptr, scale_inv_t_ptr, counts_ptr, BLOCKS: tl.constexpr,
                    TRANSPOSE: tl.constexpr, POW2: tl.constexpr, STATS: tl.constexpr, FP8_DTYPE: tl.constexpr,
                    FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, SATURATION: tl.constexpr,
                    SOFTWARE_ROUNDING: tl.constexpr):
    """quantize_triton's given-scale (BLOCKS False) or 1x128 (BLOCKS True) cast of one fp32 tile y; with STATS
    also its saturated/flushed counts (quantize_triton's two atomics per tile)."""
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.where(mask, y, 0.0)
    if BLOCKS:
        row_amax = _nan_max(tl.abs(y), 1)
        scale = _scale_from_amax(row_amax, FP8_MAX, POW2)
        tl.store(amax_ptr + pid_k * M + offs_m, row_amax, mask=row_ok)  # K-block-major, as quantize_triton
        tl.store(scale_inv_ptr + pid_k * M + offs_m, _reciprocal(scale), mask=row_ok)
        scaled = y * scale[:, None]
    else:
        scale = tl.load(scale_ptr)
        tl.store(amax_ptr + pid_m * n_k_tiles + pid_k, _nan_max(_nan_max(tl.abs(y), 1), 0))
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_inv_ptr, _reciprocal(scale))
        scaled = y * scale
    q = to_fp8_bits(scaled, FP8_DTYPE, FP8_MAX, MBITS, EMIN, SOFTWARE_ROUNDING)
    tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    if STATS:  # y is 0 outside the mask: never saturated, never a flushed nonzero
        # A 1x128 group's own amax maps to FP8_MAX: it cannot saturate (and the count costs registers, spills).
        _add_cast_counts(counts_ptr, y, scaled, q, SATURATION, CAN_SATURATE=not BLOCKS)
    if TRANSPOSE:
        t_mask = col_ok[:, None] & row_ok[None, :]
        t_ptrs = qt_ptr + offs_k[:, None] * M + offs_m[None, :]
        if BLOCKS:
            col_scale = _scale_from_amax(_nan_max(tl.abs(y), 0), FP8_MAX, POW2)
            tl.store(scale_inv_t_ptr + pid_m * K + offs_k, _reciprocal(col_scale), mask=col_ok)
            qt = to_fp8_bits(tl.trans(y) * col_scale[:, None], FP8_DTYPE, FP8_MAX, MBITS, EMIN, SOFTWARE_ROUNDING)
            tl.store(t_ptrs, qt, mask=t_mask)
        else:
            tl.store(t_ptrs, tl.trans(q), mask=t_mask)


@triton.jit
def _rmsnorm_quantize_kernel(x_ptr, w_ptr, rstd_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, scale_inv_ptr,
                             scale_inv_t_ptr, counts_ptr, M, K, eps, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             BLOCKS: tl.constexpr, TRANSPOSE: tl.constexpr, POW2: tl.constexpr, STATS: tl.constexpr,
                             FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                             SATURATION: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr):
    pid_m = tl.program_id(0)
    n_k_tiles = tl.cdiv(K, BK)
    offs_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    row_ok = offs_m < M
    sum_sq = tl.zeros((BM,), tl.float32)
    for pid_k in range(0, n_k_tiles):
        offs_k = pid_k * BK + tl.arange(0, BK).to(tl.int64)
        mask = row_ok[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
    rstd = _reciprocal(tl.sqrt_rn(tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, K, tl.float32)) + eps))
    tl.store(rstd_ptr + offs_m, rstd, mask=row_ok)
    for pid_k in range(0, n_k_tiles):
        offs_k = pid_k * BK + tl.arange(0, BK).to(tl.int64)
        col_ok = offs_k < K
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_k, mask=col_ok, other=0.0).to(tl.float32)
        normed = _round_to(x * rstd[:, None], X_DTYPE)  # cast back before the scale, as the module
        y = _round_to(normed * w[None, :], OUT_DTYPE)
        _cast_and_store(y, offs_m, offs_k, row_ok, col_ok, pid_m, pid_k, n_k_tiles, M, K, q_ptr, qt_ptr, amax_ptr,
                        scale_ptr, scale_inv_ptr, scale_inv_t_ptr, counts_ptr, BLOCKS, TRANSPOSE, POW2, STATS,
                        FP8_DTYPE, FP8_MAX, MBITS, EMIN, SATURATION, SOFTWARE_ROUNDING)


@triton.jit
def _swiglu_quantize_kernel(gu_ptr, s_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, scale_inv_ptr, scale_inv_t_ptr,
                            counts_ptr, M, K, HAS_CHANNEL_SCALE: tl.constexpr, X_DTYPE: tl.constexpr,
                            BLOCKS: tl.constexpr, TRANSPOSE: tl.constexpr, POW2: tl.constexpr, STATS: tl.constexpr,
                            FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                            SATURATION: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BM: tl.constexpr,
                            BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    offs_k = pid_k * BK + tl.arange(0, BK).to(tl.int64)
    row_ok, col_ok = offs_m < M, offs_k < K
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = gu_ptr + offs_m[:, None] * (2 * K) + offs_k[None, :]  # [gate | up], each K wide
    gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
    silu = _round_to(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), X_DTYPE)  # each op rounds, as torch's
    y = _round_to(silu * up, X_DTYPE)
    if HAS_CHANNEL_SCALE:
        y = _round_to(y * tl.load(s_ptr + offs_k, mask=col_ok, other=1.0)[None, :], X_DTYPE)
    _cast_and_store(y, offs_m, offs_k, row_ok, col_ok, pid_m, pid_k, tl.num_programs(1), M, K, q_ptr, qt_ptr,
                    amax_ptr, scale_ptr, scale_inv_ptr, scale_inv_t_ptr, counts_ptr, BLOCKS, TRANSPOSE, POW2, STATS,
                    FP8_DTYPE, FP8_MAX, MBITS, EMIN, SATURATION, SOFTWARE_ROUNDING)


def _fusable(gran: Granularity, scale: torch.Tensor | None) -> bool:
    return scale is not None or gran is Granularity.BLOCK_1X128


def tile_rows(scale: torch.Tensor | None) -> int:
    """Rows of x a program (RMSNorm) or tile (SwiGLU) covers: GIVEN_SCALE_ROWS with a given scale, else TILE (1x128)."""
    return GIVEN_SCALE_ROWS if scale is not None else TILE


def _buffers(rows: int, cols: int, gran: Granularity, scale, transpose: bool, fp8_dtype, dev):
    data = torch.empty((rows, cols), device=dev, dtype=fp8_dtype)
    data_t = torch.empty((cols, rows), device=dev, dtype=fp8_dtype) if transpose else data
    scale_inv = empty_scales(rows, cols, gran, dev)
    scale_inv_t = empty_scales(cols, rows, gran, dev) if transpose and scale is None else scale_inv
    grid_k = triton.cdiv(cols, TILE)
    amax = torch.empty((triton.cdiv(rows, tile_rows(scale)), grid_k), device=dev, dtype=torch.float32) \
        if scale is not None else empty_scales(rows, cols, gran, dev)  # given scale: one amax per tile, reduced
    return data, data_t, scale_inv, scale_inv_t, amax


def _result(data, data_t, scale_inv, scale_inv_t, amax, counts, scale, transpose: bool) -> Fp8Quantized:
    if scale is not None:
        amax = amax.amax()
        scale_inv_t = scale_inv.t().clone(memory_format=torch.contiguous_format)  # never an alias of scale_inv
    if not transpose:
        return Fp8Quantized(data, scale_inv, amax, counts=counts)
    return Fp8Quantized(data, scale_inv, amax, data_t, scale_inv_t, counts)


def _cast_constants(fp8_dtype: torch.dtype, fmt, gran: Granularity, scale: torch.Tensor | None, transpose: bool,
                    power_of_2_scale: bool, stats: bool) -> dict:
    return dict(BLOCKS=gran is Granularity.BLOCK_1X128, TRANSPOSE=transpose, POW2=power_of_2_scale, STATS=stats,
                FP8_DTYPE=triton_fp8_dtype(fp8_dtype), FP8_MAX=fmt.max, MBITS=fmt.mantissa_bits,
                EMIN=fmt.min_normal_exponent, SATURATION=fmt.saturation_threshold, SOFTWARE_ROUNDING=_interpreting(),
                BM=tile_rows(scale), BK=TILE)


def _counts(stats: bool, dev) -> torch.Tensor | None:
    return torch.zeros(2, device=dev, dtype=torch.int64) if stats else None


def rmsnorm_quantize_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype,
                            granularity_: str | Granularity = Granularity.TENSORWISE, *,
                            power_of_2_scale: bool = False, scale: torch.Tensor | None = None,
                            transpose: bool = False, stats: bool = False) -> tuple[Fp8Quantized, torch.Tensor]:
    """Triton twin of `rmsnorm_quantize_reference` (same arguments and results)."""
    gran = granularity(granularity_)
    fmt = check_quantize_args(x, fp8_dtype, gran, scale)
    if not _fusable(gran, scale) or x.dtype not in _TORCH_TO_TL or weight.dtype not in _TORCH_TO_TL:
        normed, rstd = rms_norm_forward_reference(x, weight, eps)
        return quantize_triton(normed, fp8_dtype, gran, power_of_2_scale=power_of_2_scale, scale=scale,
                               transpose=transpose, stats=stats), rstd
    x, weight = x.contiguous(), weight.contiguous()
    M, K = x.shape
    data, data_t, scale_inv, scale_inv_t, amax = _buffers(M, K, gran, scale, transpose, fp8_dtype, x.device)
    rstd = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    counts = _counts(stats, x.device)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    _rmsnorm_quantize_kernel[(triton.cdiv(M, tile_rows(scale)),)](
        x, weight, rstd, data.view(torch.uint8), data_t.view(torch.uint8), amax,
        scale if scale is not None else scale_inv, scale_inv, scale_inv_t, counts if stats else scale_inv, M, K, eps,
        X_DTYPE=_TORCH_TO_TL[x.dtype], OUT_DTYPE=_TORCH_TO_TL[out_dtype],
        **_cast_constants(fp8_dtype, fmt, gran, scale, transpose, power_of_2_scale, stats), num_warps=8)
    return _result(data, data_t, scale_inv, scale_inv_t, amax, counts, scale, transpose), rstd


def swiglu_quantize_triton(gate_up: torch.Tensor, channel_scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                           granularity_: str | Granularity = Granularity.TENSORWISE, *,
                           power_of_2_scale: bool = False, scale: torch.Tensor | None = None,
                           transpose: bool = False, stats: bool = False) -> Fp8Quantized:
    """Triton twin of `swiglu_quantize_reference` (same arguments and results)."""
    gran = granularity(granularity_)
    M, K = gate_up.shape[0], gate_up.shape[1] // 2
    fmt = check_quantize_args(gate_up[:, :K], fp8_dtype, gran, scale)
    if not _fusable(gran, scale) or gate_up.dtype not in _TORCH_TO_TL:
        gate, up = gate_up.chunk(2, dim=-1)
        return quantize_triton(swiglu_reference(gate, up, channel_scale), fp8_dtype, gran,
                               power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose, stats=stats)
    gate_up = gate_up.contiguous()
    data, data_t, scale_inv, scale_inv_t, amax = _buffers(M, K, gran, scale, transpose, fp8_dtype, gate_up.device)
    s = channel_scale.float().contiguous() if channel_scale is not None else scale_inv
    counts = _counts(stats, gate_up.device)
    _swiglu_quantize_kernel[(triton.cdiv(M, tile_rows(scale)), triton.cdiv(K, TILE))](
        gate_up, s, data.view(torch.uint8), data_t.view(torch.uint8), amax,
        scale if scale is not None else scale_inv, scale_inv, scale_inv_t, counts if stats else scale_inv, M, K,
        HAS_CHANNEL_SCALE=channel_scale is not None, X_DTYPE=_TORCH_TO_TL[gate_up.dtype],
        **_cast_constants(fp8_dtype, fmt, gran, scale, transpose, power_of_2_scale, stats), num_warps=8)
    return _result(data, data_t, scale_inv, scale_inv_t, amax, counts, scale, transpose)


assert BLOCK == TILE  # a 1x128 group is one tile row; its transposed 128x1 group one tile column
