"""Triton FP8 quantization: amax -> scale -> saturating cast, with an optional fused transpose.

Twin: quantize_reference.py (same signature, same bits). Scaling groups live in 128x128 tiles. Every launch is
4-warp programs that each cover TILES_PER_PROGRAM consecutive K tiles of one 128-row group, carry their running
amax and counts in registers, and do their atomics once at the end (not per tile). The cast holds SLAB rows of a
tile at a time (SLAB_TRANSPOSED with the transposed copy) to stay clear of spills at 4 warps:
- block granularities are one fused kernel: a 1x128 group lies in one slab's row; a 128x128 block, and the
  transposed copy's 128x1 columns of block 1x128, need the amax of all 128 rows before their cast, so those
  casts pass over the tile's slabs twice (amax, then cast; the second pass reads them from L2);
- tensorwise and rowwise current scaling need the amax of a whole tensor/row first, so they run an amax kernel
  (whole 128x128 tiles) that atomically MAXes each program's amax into the tensor's/rows' amax (and, rowwise
  with the transposed copy, each tile's into its columns'), then the cast reads it: no torch reduce in between;
- a given scale (delayed scaling) is one pass that also returns the tensor amax for the next update (the
  same atomic MAX).
The amax atomics work on the fp32 bits as int32: non-negative floats order like their bits, and a NaN
(0x7FC00000, positive: |x| clears the sign) orders above +inf, so a NaN anywhere still wins, as torch.amax's.
The transposed copy (x.T in FP8, K-major for dgrad/wgrad) is written from the same registers. With
stats=True the cast also counts saturated and flushed elements: two int64 atomic adds per program (one for
the block granularities, whose casts cannot saturate).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .scaling import (
    BLOCK,
    FLOAT32_MAX,
    Fp8Quantized,
    Granularity,
    check_quantize_args,
    empty_scales,
    granularity,
)

TILE = BLOCK
TILES_PER_PROGRAM = 4  # consecutive K tiles per program: its amax/stats atomics happen once for all of them
# Rows of a tile a cast program holds at once: 32x128 over 4 warps is 32 values per thread. A transposing cast
# holds 16: the shared-memory shuffle of the transpose keeps ~40 addresses live across the slab loop, and at 32
# rows its variants took 111-216 registers and the given-scale one with stats spilled (sm_90a audit,
# tools/bench/kernel_audit.py); at 16 every variant stays at or below 128 (4 programs per SM).
SLAB = 32
SLAB_TRANSPOSED = 16
WARPS = 4
_FLOAT32_MAX = tl.constexpr(FLOAT32_MAX)
_MODE = {  # constexpr codes for the cast kernel
    Granularity.TENSORWISE: 0,
    Granularity.ROWWISE: 1,
    Granularity.BLOCK_1X128: 2,
    Granularity.BLOCK_128X128: 3,
}
_GIVEN_SCALE = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_fp8_dtype(dtype: torch.dtype):
    return tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5


# ----------------------------------------------------------------------------------------------------
# jit helpers: the same rules as quantize_reference.py, written for tiles
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _nan_max(a, axis: tl.constexpr):
    # max of |x| that returns NaN when a NaN is present (GPU max instructions drop NaN).
    has_nan = tl.max((a != a).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(a, axis=axis))


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)  # IEEE division, like torch
    scale = tl.where(amax == 0, 1.0, scale)
    scale = tl.minimum(scale, _FLOAT32_MAX)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax < float("inf"), scale, float("nan"))  # amax is >= 0, NaN or inf


@triton.jit
def _reciprocal(scale):
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _round_to_fp8_grid(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    # Round-to-nearest-even onto the FP8 grid in fp32 arithmetic. Used under the interpreter, whose
    # fp32->fp8 conversion drops the carry into the exponent (127.9 -> 120 instead of 128); on GPU
    # the hardware cvt.rn already rounds correctly and this is skipped.
    bits = y.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    quantum_exp = tl.maximum(exponent, EMIN) - MBITS  # spacing of the FP8 grid around y
    quantum = ((quantum_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - quantum_exp) << 23).to(tl.float32, bitcast=True)
    steps = magnitude * inv_quantum  # exact: a power-of-two scaling
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 addition rounds to an even integer
    rounded = (steps * quantum).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def to_fp8_bits(y, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                 SOFTWARE_ROUNDING: tl.constexpr):
    """Saturating fp32 -> FP8 cast, returned as uint8 bits (the kernels store through uint8 views).
    Finite values past the range saturate; inf becomes NaN (an overflow already happened upstream)."""
    is_nan = y != y
    is_inf = tl.abs(y) == float("inf")
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if SOFTWARE_ROUNDING:
        y = _round_to_fp8_grid(y, MBITS, EMIN)
    bits = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True)
    # 0x7F/0xFF is NaN in both E4M3FN and E5M2; a NaN keeps its sign, an inf becomes +NaN (as torch's).
    return tl.where(is_nan, sign | 0x7F, tl.where(is_inf, 0x7F, bits))


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _nan_maximum(a, b):
    # elementwise max that keeps a NaN from either side (GPU max instructions drop NaN)
    return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))


@triton.jit
def _atomic_amax(amax_bits_ptr, amax, mask=None):
    # MAX into zero-initialised fp32 amaxes through their int32 bits (see the module docstring).
    tl.atomic_max(amax_bits_ptr, amax.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _cast_counts(x, y, q, SATURATION: tl.constexpr, CAN_SATURATE: tl.constexpr = True):
    """A tile's saturated (|y| > SATURATION, y = x * scale) and flushed (x != 0 cast to +-0, read on the FP8
    bits q) counts, as int32 (half the registers of int64 lanes; a program's few tiles fit easily): the
    definitions of quantize_reference.cast_counts. CAN_SATURATE=False: a cast whose scale comes from its own
    group's amax, which never saturates (counted as 0)."""
    saturated = 0
    if CAN_SATURATE:
        saturated = tl.sum((tl.abs(y) > SATURATION).to(tl.int32))
    return saturated, tl.sum((((q & 0x7F) == 0) & (x != 0)).to(tl.int32))


@triton.jit
def _atomic_add_counts(counts_ptr, saturated, flushed, CAN_SATURATE: tl.constexpr = True):
    # The running totals in counts_ptr[0:2] are int64.
    if CAN_SATURATE:
        tl.atomic_add(counts_ptr, saturated.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, flushed.to(tl.int64))


@triton.jit
def _add_cast_counts(counts_ptr, x, y, q, SATURATION: tl.constexpr, CAN_SATURATE: tl.constexpr = True):
    """Add one tile's counts (_cast_counts) to counts_ptr[0:2]: two atomics."""
    saturated, flushed = _cast_counts(x, y, q, SATURATION, CAN_SATURATE)
    _atomic_add_counts(counts_ptr, saturated, flushed, CAN_SATURATE)


@triton.jit
def _tile_amax_kernel(x_ptr, amax_bits_ptr, col_amax_bits_ptr, M, K, ROWS: tl.constexpr, COLS: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr):
    """MAX the amax of TILES_PER_PROGRAM consecutive K tiles into the tensor's (or each row's) amax, once per
    program, and (rowwise transpose) each tile's column amaxes into the columns' (the tiles' columns differ)."""
    first_k = tl.program_id(1) * TILES_PER_PROGRAM
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM).to(tl.int64)  # int64: M * K may exceed 2**31
    row_ok = offs_m < M
    row_amax = tl.zeros((BM,), tl.float32)
    for pid_k in range(first_k, tl.minimum(first_k + TILES_PER_PROGRAM, tl.cdiv(K, BK))):
        offs_k = pid_k * BK + tl.arange(0, BK).to(tl.int64)
        mask = row_ok[:, None] & (offs_k < K)[None, :]
        a = tl.abs(tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32))
        row_amax = _nan_maximum(row_amax, _nan_max(a, 1))
        if COLS:
            _atomic_amax(col_amax_bits_ptr + offs_k, _nan_max(a, 0), mask=offs_k < K)
    if ROWS:
        _atomic_amax(amax_bits_ptr + offs_m, row_amax, mask=row_ok)
    else:
        _atomic_amax(amax_bits_ptr, _nan_max(row_amax, 0))


@triton.jit
def _load_slab(x_ptr, row0, offs_k, col_ok, M, K, SLAB: tl.constexpr):
    """SLAB rows from row0 of one K tile, as fp32 (0 outside the tensor), with their offsets and masks."""
    offs_m = row0 + tl.arange(0, SLAB).to(tl.int64)  # int64: M * K may exceed 2**31
    row_ok = offs_m < M
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, offs_m, row_ok, mask


@triton.jit
def _tile_col_amax(x_ptr, row0, offs_k, col_ok, M, K, BM: tl.constexpr, SLAB: tl.constexpr):
    """Column amaxes of the BM-row tile from row0, slab by slab: the 128x1 groups (and, reduced once more,
    the 128x128 block) whose scale the cast needs before its first slab."""
    col_amax = tl.zeros(offs_k.shape, tl.float32)
    for slab_row0 in range(row0, row0 + BM, SLAB):
        x, _, _, _ = _load_slab(x_ptr, slab_row0, offs_k, col_ok, M, K, SLAB)
        col_amax = _nan_maximum(col_amax, _nan_max(tl.abs(x), 0))
    return col_amax


@triton.jit
def _cast_tile_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, col_amax_ptr, scale_ptr, scale_inv_ptr, scale_inv_t_ptr,
                      counts_ptr, M, K, MODE: tl.constexpr, TRANSPOSE: tl.constexpr, POW2: tl.constexpr,
                      STATS: tl.constexpr, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,
                      EMIN: tl.constexpr, SATURATION: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, SLAB: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr):
    """Scale and cast TILES_PER_PROGRAM consecutive K tiles of one BM-row group, SLAB rows at a time; writes
    the row-major bytes, optionally the transposed bytes, and scales.

    MODE 0 tensorwise (amax precomputed), 1 rowwise (row/col amax precomputed), 2 block 1x128,
    3 block 128x128, 4 given scale (MAXes the program's amax into amax_ptr for the delayed-scaling history).
    STATS: add the program's saturated (|y| > SATURATION) and flushed (x != 0 cast to +-0) counts to
    counts_ptr[0:2] (int64), the definitions of quantize_reference.cast_counts.
    """
    pid_m, pid_p = tl.program_id(0), tl.program_id(1)
    n_k_tiles = tl.cdiv(K, BK)
    first_k = pid_p * TILES_PER_PROGRAM
    group_row0 = pid_m.to(tl.int64) * BM
    # A group's own amax maps to FP8_MAX: a block cast cannot saturate (and not counting saves registers).
    CAN_SATURATE: tl.constexpr = MODE != 2 and MODE != 3
    saturated, flushed = 0, 0
    if MODE == 0 or MODE == 4:
        if MODE == 0:
            tensor_scale = _scale_from_amax(tl.load(amax_ptr), FP8_MAX, POW2)
        else:
            tensor_scale = tl.load(scale_ptr)
            program_amax = 0.0

    # A constant trip count and a guard, not range(first_k, min(first_k + TILES_PER_PROGRAM, n_k_tiles)): Triton 3.6's
    # ptxas (the GPU image's) kept that bound in local memory across the loop, 4 B of spill in block 128x128 + stats.
    for tile in range(0, TILES_PER_PROGRAM):
        pid_k = first_k + tile
        if pid_k < n_k_tiles:
            offs_k = pid_k * BK + tl.arange(0, BK).to(tl.int64)
            col_ok = offs_k < K
            if MODE == 3 or (MODE == 2 and TRANSPOSE):
                # 128-row groups: their amax first (a first pass over the slabs; the second reads them from L2).
                group_col_amax = _tile_col_amax(x_ptr, group_row0, offs_k, col_ok, M, K, BM, SLAB)
            if MODE == 3:
                block_amax = _nan_max(group_col_amax, 0)
                block_scale = _scale_from_amax(block_amax, FP8_MAX, POW2)
                tl.store(amax_ptr + pid_m * n_k_tiles + pid_k, block_amax)
                tl.store(scale_inv_ptr + pid_m * n_k_tiles + pid_k, _reciprocal(block_scale))
            if TRANSPOSE:
                # The transposed copy has its own groups: whole columns (rowwise) or 128x1 (block 1x128).
                if MODE == 1:
                    col_scale = _scale_from_amax(tl.load(col_amax_ptr + offs_k, mask=col_ok, other=0.0), FP8_MAX, POW2)
                    if pid_m == 0:
                        tl.store(scale_inv_t_ptr + offs_k, _reciprocal(col_scale), mask=col_ok)
                elif MODE == 2:
                    col_scale = _scale_from_amax(group_col_amax, FP8_MAX, POW2)
                    tl.store(scale_inv_t_ptr + pid_m * K + offs_k, _reciprocal(col_scale), mask=col_ok)  # K-block-major

            for row0 in range(group_row0, group_row0 + BM, SLAB):
                x, offs_m, row_ok, mask = _load_slab(x_ptr, row0, offs_k, col_ok, M, K, SLAB)
                if MODE == 0:
                    y = x * tensor_scale
                elif MODE == 1:
                    row_scale = _scale_from_amax(tl.load(amax_ptr + offs_m, mask=row_ok, other=0.0), FP8_MAX, POW2)
                    if pid_k == 0:
                        tl.store(scale_inv_ptr + offs_m, _reciprocal(row_scale), mask=row_ok)
                    y = x * row_scale[:, None]
                elif MODE == 2:
                    # 1x128 scales (and amaxes) are K-block-major, (K/128, M) in memory: a slab's column of
                    # scales is one contiguous store, and the GEMM's K step one contiguous load.
                    row_amax = _nan_max(tl.abs(x), 1)
                    row_scale = _scale_from_amax(row_amax, FP8_MAX, POW2)
                    tl.store(amax_ptr + pid_k * M + offs_m, row_amax, mask=row_ok)
                    tl.store(scale_inv_ptr + pid_k * M + offs_m, _reciprocal(row_scale), mask=row_ok)
                    y = x * row_scale[:, None]
                elif MODE == 3:
                    y = x * block_scale
                else:
                    program_amax = _nan_maximum(program_amax, _nan_max(_nan_max(tl.abs(x), 1), 0))
                    y = x * tensor_scale
                q = to_fp8_bits(y, FP8_DTYPE, FP8_MAX, MBITS, EMIN, SOFTWARE_ROUNDING)
                tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
                if STATS:  # padding loads x = 0: never saturated, never a flushed nonzero
                    slab_saturated, slab_flushed = _cast_counts(x, y, q, SATURATION, CAN_SATURATE)
                    saturated += slab_saturated
                    flushed += slab_flushed
                if TRANSPOSE:
                    t_mask = col_ok[:, None] & row_ok[None, :]
                    t_ptrs = qt_ptr + offs_k[:, None] * M + offs_m[None, :]
                    if MODE == 1 or MODE == 2:
                        qt = to_fp8_bits(tl.trans(x) * col_scale[:, None], FP8_DTYPE, FP8_MAX, MBITS, EMIN,
                                          SOFTWARE_ROUNDING)
                        tl.store(t_ptrs, qt, mask=t_mask)
                    else:
                        tl.store(t_ptrs, tl.trans(q), mask=t_mask)

    # once per program, not per tile
    if MODE == 0 or MODE == 4:
        # After the loop, not before it: there, under Triton 3.6, ptxas kept the thread index its predicate needs in
        # local memory across the loop (8 B of spill with a given scale + stats).
        if (pid_m == 0) & (pid_p == 0):
            tl.store(scale_inv_ptr, _reciprocal(tensor_scale))
    if MODE == 4:
        _atomic_amax(amax_ptr, program_amax)
    if STATS:
        _atomic_add_counts(counts_ptr, saturated, flushed, CAN_SATURATE)


# ----------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------
def quantize_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity_: str | Granularity = Granularity.TENSORWISE,
    *,
    power_of_2_scale: bool = False,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    stats: bool = False,
) -> Fp8Quantized:
    """Triton twin of `quantize_reference` (same arguments, same bits)."""
    gran = granularity(granularity_)
    fmt = check_quantize_args(x, fp8_dtype, gran, scale)
    x = x.contiguous()
    M, K = x.shape
    dev = x.device
    grid = (triton.cdiv(M, TILE), triton.cdiv(triton.cdiv(K, TILE), TILES_PER_PROGRAM))
    f32 = dict(device=dev, dtype=torch.float32)

    data = torch.empty((M, K), device=dev, dtype=fp8_dtype)
    data_t = torch.empty((K, M), device=dev, dtype=fp8_dtype) if transpose else None
    scale_inv = empty_scales(M, K, gran, dev)
    scale_inv_t = None
    if transpose and gran in (Granularity.ROWWISE, Granularity.BLOCK_1X128):
        scale_inv_t = empty_scales(K, M, gran, dev)
    counts = torch.zeros(2, device=dev, dtype=torch.int64) if stats else None

    dummy = scale_inv  # stands in for pointers a mode does not touch
    col_amax = dummy
    if scale is not None:
        mode = _GIVEN_SCALE
        amax = torch.zeros((), **f32)  # the cast MAXes every program's amax into it
    elif gran is Granularity.TENSORWISE:
        mode = _MODE[gran]
        amax = torch.zeros((), **f32)
        _tile_amax_kernel[grid](x, amax.view(torch.int32), dummy, M, K, ROWS=False, COLS=False, BM=TILE, BK=TILE,
                                TILES_PER_PROGRAM=TILES_PER_PROGRAM, num_warps=WARPS)
    elif gran is Granularity.ROWWISE:
        mode = _MODE[gran]
        amax = torch.zeros((M, 1), **f32)
        col_amax = torch.zeros(K, **f32) if transpose else dummy
        _tile_amax_kernel[grid](x, amax.view(torch.int32), col_amax.view(torch.int32), M, K, ROWS=True,
                                COLS=transpose, BM=TILE, BK=TILE, TILES_PER_PROGRAM=TILES_PER_PROGRAM,
                                num_warps=WARPS)
    else:
        mode = _MODE[gran]
        amax = empty_scales(M, K, gran, dev)

    _cast_tile_kernel[grid](
        x, data.view(torch.uint8), data_t.view(torch.uint8) if transpose else data.view(torch.uint8),
        amax.view(torch.int32) if mode == _GIVEN_SCALE else amax, col_amax, scale if scale is not None else dummy,
        scale_inv, scale_inv_t if scale_inv_t is not None else dummy, counts if stats else dummy,
        M, K, MODE=mode, TRANSPOSE=transpose, POW2=power_of_2_scale, STATS=stats,
        FP8_DTYPE=triton_fp8_dtype(fp8_dtype), FP8_MAX=fmt.max, MBITS=fmt.mantissa_bits,
        EMIN=fmt.min_normal_exponent, SATURATION=fmt.saturation_threshold, SOFTWARE_ROUNDING=_interpreting(),
        BM=TILE, BK=TILE, SLAB=SLAB_TRANSPOSED if transpose else SLAB, TILES_PER_PROGRAM=TILES_PER_PROGRAM,
        num_warps=WARPS,
    )
    if transpose and scale_inv_t is None:
        scale_inv_t = scale_inv.t().clone(memory_format=torch.contiguous_format)  # never an alias of scale_inv
    return Fp8Quantized(data, scale_inv, amax, data_t, scale_inv_t, counts)
