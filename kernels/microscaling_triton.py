"""Triton microscaling quantizers (MXFP8, MXFP4, NVFP4): the twin of microscaling.quantize_microscaled, bit for bit.

The rules are microscaling_reference.py's (its docstring states them exactly); this file restates them for tiles.
One launch quantizes one copy: a program holds ROWS x COLS elements of the copy (the row-major copy reads x, the
transposed copy reads x through swapped strides, never a materialised x.T), takes the amax of its 1x32, 1x16 or
16x16 blocks, derives the scales, scales, rounds (to nearest even, or stochastically from the counter hash at the
copy's flat index) and stores the payload (FP8 bytes, or E2M1 codes two per byte, the even element in the low
nibble), the scale bytes, the block amaxes (row-major copy) and the [saturated, flushed] counts (one int64 atomic
add each per program). NVFP4's per-tensor S_enc comes from a given tensor, or from an amax pass (atomic MAX on the
fp32 bits as int32, as quantize_triton.py) that the cast then reads: no host sync.
The Hadamard-transformed transposed copy loads its 16 inputs of each output one column at a time and sums the 16
exact products in fp64 (the twin's rule), so its bits match the twin's wherever the fp64 sum is exact (16 fp32
inputs within ~2^25 of each other, which covers real data; the twin's own matmul order is unspecified too).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl

from .counter_hash_triton import counter_uniform_triton
from .formats import E2M1, ElementFormat, ScaleFormat, ScaleLayout
from .microscaling_reference import HADAMARD_SIZE, hadamard_matrix, transposed_key
from .quantize_triton import _interpreting, to_fp8_bits, triton_fp8_dtype
from .quantized_tensor import QuantizedTensor
from .scaling import FLOAT32_MAX

# A program's tile of the copy: 16 rows (one 16x16 block row; a whole number of 1x16 / 1x32 rows) by 128 columns
# (4 MX or 8 NVFP4 blocks), 16 values per thread at 4 warps (tools/bench/kernel_audit_blackwell.py: no spills).
ROWS, COLS, WARPS = 16, 128, 4
_ONE_SIXTH = float(np.float32(1.0) / np.float32(E2M1.max))  # the twin's ones / 6, rounded once to fp32
_FLOAT32_MAX = tl.constexpr(FLOAT32_MAX)


# ---- helpers: the twin's rules on tiles -----------------------------------------------------------------------------

@triton.jit
def _nan_max(a, axis: tl.constexpr):
    # max that returns NaN when a NaN is present (GPU max instructions drop NaN; torch.amax keeps it)
    has_nan = tl.max((a != a).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(a, axis=axis))


@triton.jit
def _keep_nan_min(a, bound):
    # min(a, bound) that keeps a NaN (torch.clamp does; PTX min.f32 returns the other operand)
    return tl.where(a != a, a, tl.minimum(a, bound))


@triton.jit
def _floor_log2(q):
    """(floor(log2 q), q is a power of two) for positive finite fp32 q, subnormals included, in integer ops (no
    float multiply a flush-to-zero mode could touch)."""
    bits = q.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # A subnormal's integer mantissa converted to fp32 (exact below 2^24) carries its floor(log2) in the exponent.
    sub_exponent = ((mantissa.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 149
    floor = tl.where(exponent == 0, sub_exponent, exponent - 127)
    pow2 = tl.where(exponent == 0, (mantissa & (mantissa - 1)) == 0, mantissa == 0)
    return floor, pow2


@triton.jit
def _e8m0_bytes(amax, ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, FLOOR: tl.constexpr):
    """Block amaxes -> biased E8M0 bytes (int32 0..255): e8m0_exponents."""
    positive = amax > 0
    finite = amax < float("inf")  # amax >= 0 or NaN
    safe = tl.where(positive & finite, amax, 1.0)
    if FLOOR:  # OCP: floor(log2(amax)) - the element's largest exponent
        floor, _ = _floor_log2(safe)
        unbiased = floor - ELEM_EMAX
    else:  # RCEIL: ceil(log2(amax / ELEM_MAX))
        q = tl.math.div_rn(safe, tl.full(safe.shape, ELEM_MAX, tl.float32))
        floor, pow2 = _floor_log2(q)
        # q == 0 (an underflowing quotient) reads as floor -276, clamped below to -127: the smallest scale (the twin too)
        unbiased = floor + tl.where(pow2, 0, 1)
    unbiased = tl.where(positive, unbiased, -127)
    biased = tl.minimum(tl.maximum(unbiased, -127), 127) + 127
    return tl.where(finite, biased, 255)


@triton.jit
def _e8m0_encode_factor(biased):
    """What x is multiplied by: 2^(127 - e) built from its bits (2^-127 is the subnormal 0x00400000), 1 for byte 0,
    NaN for 0xFF: _mx_encode_factor."""
    bits = tl.where(biased == 254, 0x00400000, (254 - biased) << 23)
    factor = bits.to(tl.float32, bitcast=True)
    factor = tl.where(biased == 0, 1.0, factor)
    return tl.where(biased == 255, float("nan"), factor)


@triton.jit
def _e2m1_codes(scaled, uniform, STOCHASTIC: tl.constexpr):
    """fp32 (already scaled) -> E2M1 codes (int32 0..15): e2m1_codes. NaN -> +0; clamp to 6; round to nearest even on
    the grid step at |x| (0.5 below 2, 1 below 4, else 2), or up with probability (|x| - lo) / step."""
    x = tl.where(scaled != scaled, 0.0, scaled)
    magnitude = tl.minimum(tl.abs(x), 6.0)
    quantum = tl.where(magnitude < 2, 0.5, tl.where(magnitude < 4, 1.0, 2.0))
    steps = magnitude * tl.where(magnitude < 2, 2.0, tl.where(magnitude < 4, 1.0, 0.5))  # exact: a power of two
    if STOCHASTIC:
        lo = tl.floor(steps) * quantum
        rounded = tl.where(uniform < (magnitude - lo) / quantum, lo + quantum, lo)
    else:
        rounded = ((steps + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2^23: fp32 addition rounds half to even
    code = tl.where(rounded < 2, rounded * 2, tl.where(rounded < 4, rounded + 2, rounded * 0.5 + 4)).to(tl.int32)
    return code | tl.where(x < 0, 8, 0)


@triton.jit
def _to_fp32(v):
    # bf16 widened through its bits: exact, and Triton's interpreter flushes bf16 subnormals in its .to(float32)
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _load_tile(x_ptr, hadamard_ptr, row0, col0, R, C, stride_r, stride_c, HADAMARD: tl.constexpr,
               BR: tl.constexpr, BC: tl.constexpr):
    """The copy's (BR, BC) tile at (row0, col0) as fp32, 0 outside. HADAMARD: every 16 columns times M (16 x 16,
    fp64), out[j] = sum_i x[i] M[i, j] summed in fp64 and rounded once (random_hadamard_transform); C % 16 == 0."""
    offs_r = row0 + tl.arange(0, BR).to(tl.int64)  # int64: rows * stride may pass 2^31
    row_ok = offs_r < R
    if HADAMARD:
        group_col0 = col0 + 16 * tl.arange(0, BC // 16).to(tl.int64)
        mask = row_ok[:, None] & (group_col0 < C)[None, :]
        acc = tl.zeros((BR, BC // 16, 16), tl.float64)
        for i in tl.static_range(16):  # one input column of every group at a time: no register shuffles
            xi = _to_fp32(tl.load(x_ptr + offs_r[:, None] * stride_r + (group_col0 + i)[None, :] * stride_c,
                                  mask=mask, other=0.0)).to(tl.float64)
            m_i = tl.load(hadamard_ptr + i * 16 + tl.arange(0, 16))
            acc += xi[:, :, None] * m_i[None, None, :]  # the products are exact (M's entries are +-1/4)
        return tl.reshape(acc, (BR, BC)).to(tl.float32)
    offs_c = col0 + tl.arange(0, BC).to(tl.int64)
    mask = row_ok[:, None] & (offs_c < C)[None, :]
    return _to_fp32(tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0))


@triton.jit
def _block_amax(x, BR: tl.constexpr, BC: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr):
    """(BR / GR, BC / GC) block amaxes of a (BR, BC) tile; GR is 1 or BR (a 16x16 block row is the whole tile): two
    plain reductions, no 4-D reshape (whose layout conversions took 255 registers and spilled on sm_100a)."""
    block_amax = _nan_max(tl.reshape(tl.abs(x), (BR, BC // GC, GC)), 2)
    if GR != 1:
        block_amax = tl.reshape(_nan_max(block_amax, 0), (1, BC // GC))
    return block_amax


@triton.jit
def _expand(block_values, BR: tl.constexpr, BC: tl.constexpr, GC: tl.constexpr):
    # (BR / GR, BC / GC) per-block values -> (BR, BC) per element (GR = BR broadcasts the one block row)
    return tl.reshape(tl.broadcast_to(block_values[:, :, None], (BR, BC // GC, GC)), (BR, BC))


# ---- kernels ----------------------------------------------------------------------------------------------------

@triton.jit
def _microscaled_amax_kernel(x_ptr, amax_bits_ptr, hadamard_ptr, R, C, stride_r, stride_c, HADAMARD: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr):
    """MAX |x| of one tile (of the copy, transformed with HADAMARD) into the tensor's fp32 amax through its int32 bits:
    non-negative floats order like their bits and NaN (0x7FC00000 once |x| clears the sign) above inf."""
    x = _load_tile(x_ptr, hadamard_ptr, tl.program_id(0) * BR, tl.program_id(1) * BC, R, C, stride_r, stride_c,
                   HADAMARD, BR, BC)
    a = tl.abs(x)
    amax = tl.where(tl.max((a != a).to(tl.int32)) > 0, float("nan"), tl.max(a))
    tl.atomic_max(amax_bits_ptr, amax.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["key"])  # a key is any 32-bit value: one compile for all (i32 or u32 by value)
def _microscaled_cast_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, counts_ptr, key, hadamard_ptr, tensor_ptr,
                             global_inv_ptr, R, C, stride_r, stride_c, scale_rows, scale_cols,
                             NVFP4: tl.constexpr, PACKED: tl.constexpr, FP8_DTYPE: tl.constexpr,
                             ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                             SATURATION: tl.constexpr, FLUSH: tl.constexpr, FLOOR: tl.constexpr,
                             OWN_ENCODE_SCALE: tl.constexpr, ONE_SIXTH: tl.constexpr, HADAMARD: tl.constexpr,
                             STOCHASTIC: tl.constexpr, STATS: tl.constexpr, WRITE_AMAX: tl.constexpr,
                             SOFTWARE_ROUNDING: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr):
    """Quantize one (BR, BC) tile of a copy (R, C): mx_quantize_copy (NVFP4 False) or nvfp4_quantize_copy.

    tensor_ptr: NVFP4's fp32 tensor amax (OWN_ENCODE_SCALE) or the given S_enc; global_inv_ptr gets 1 / S_enc.
    Payload: FP8 bytes (R, C), or (PACKED) E2M1 codes (R, C / 2). Scales (scale_rows, scale_cols): E8M0 bytes or
    E4M3 bytes. amax_ptr: the fp32 block amaxes (WRITE_AMAX). counts_ptr[0:2] += [saturated, flushed] (STATS)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    row0, col0 = pid_r * BR, pid_c * BC
    x = _load_tile(x_ptr, hadamard_ptr, row0, col0, R, C, stride_r, stride_c, HADAMARD, BR, BC)
    block_amax = _block_amax(x, BR, BC, GR, GC)  # padding loads 0
    block_r = row0 // GR + tl.arange(0, BR // GR)
    block_c = col0 // GC + tl.arange(0, BC // GC)
    block_ok = (block_r < scale_rows)[:, None] & (block_c < scale_cols)[None, :]
    block_offs = block_r.to(tl.int64)[:, None] * scale_cols + block_c[None, :]
    if WRITE_AMAX:
        tl.store(amax_ptr + block_offs, block_amax, mask=block_ok)

    if NVFP4:
        # TransformerEngine's chain: S_enc = 448 * 6 / amax, block scale e4m3(min(amax_b * (S_enc * (1/6)), 448)),
        # values x * min(1 / (s_b * (1 / S_enc)), FLOAT32_MAX); every division IEEE (div_rn), as torch's.
        if OWN_ENCODE_SCALE:
            amax = tl.load(tensor_ptr)
            s_enc = tl.minimum(tl.math.div_rn(448.0 * 6.0, amax), _FLOAT32_MAX)  # amax 0: inf -> FLOAT32_MAX
            s_enc = tl.where(amax == 0, 1.0, s_enc)
            s_enc = tl.where(amax < float("inf"), s_enc, float("nan"))
        else:
            s_enc = tl.load(tensor_ptr)
        s_dec = tl.math.div_rn(1.0, s_enc)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(global_inv_ptr, s_dec)
        s_block = _keep_nan_min(block_amax * (s_enc * ONE_SIXTH), 448.0)
        scale_bits = to_fp8_bits(s_block, tl.float8e4nv, 448.0, 3, -6, SOFTWARE_ROUNDING)
        s_block = scale_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        encode = _keep_nan_min(tl.math.div_rn(tl.full(s_block.shape, 1.0, tl.float32), s_block * s_dec),
                               _FLOAT32_MAX)
        dead = s_block == 0  # a block scale that rounded to 0: its values dequantize to 0 (flushed, not saturated)
    else:
        scale_bits = _e8m0_bytes(block_amax, ELEM_MAX, ELEM_EMAX, FLOOR)
        encode = _e8m0_encode_factor(scale_bits)
    tl.store(scale_ptr + block_offs, scale_bits.to(tl.uint8), mask=block_ok)
    encode = _expand(encode, BR, BC, GC)
    # A NaN block's values are the factor's (positive) NaN, as the twin's on CPU and any product on a GPU, whatever
    # the NaN input's sign (x86 and numpy keep the first NaN operand): its FP8 bytes are 0x7F.
    scaled = tl.where(encode != encode, encode, x * encode)

    offs_r = row0 + tl.arange(0, BR).to(tl.int64)
    offs_c = col0 + tl.arange(0, BC).to(tl.int64)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    if STATS:  # the definitions of _cast_counts (padding loads 0: never counted)
        magnitude = tl.abs(scaled)
        is_saturated = magnitude > SATURATION
        is_flushed = (magnitude <= FLUSH) & (x != 0)
        if NVFP4:
            dead_element = _expand(dead.to(tl.int32), BR, BC, GC) != 0
            is_saturated = is_saturated & ~dead_element
            is_flushed = is_flushed | (dead_element & (x != 0))
        saturated = tl.sum(tl.sum(is_saturated.to(tl.int32), axis=1), axis=0)
        flushed = tl.sum(tl.sum(is_flushed.to(tl.int32), axis=1), axis=0)
        tl.atomic_add(counts_ptr, saturated.to(tl.int64))
        tl.atomic_add(counts_ptr + 1, flushed.to(tl.int64))
    if PACKED:
        uniform = scaled  # unused without STOCHASTIC
        if STOCHASTIC:  # the copy's flat index r * C + c, hashed with the copy's key (counter_uniform_at)
            uniform = counter_uniform_triton(key.to(tl.int64), offs_r[:, None] * C + offs_c[None, :])
        codes = _e2m1_codes(scaled, uniform, STOCHASTIC)
        even, odd = tl.split(tl.reshape(codes, (BR, BC // 2, 2)))
        packed = (even | (odd << 4)).to(tl.uint8)
        offs_p = col0 // 2 + tl.arange(0, BC // 2).to(tl.int64)
        tl.store(q_ptr + offs_r[:, None] * (C // 2) + offs_p[None, :], packed,
                 mask=(offs_r < R)[:, None] & (offs_p < C // 2)[None, :])
    else:
        q = to_fp8_bits(scaled, FP8_DTYPE, ELEM_MAX, MBITS, EMIN, SOFTWARE_ROUNDING)
        tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)


# ---- launcher ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _hadamard_on(device: torch.device) -> torch.Tensor:
    """M = D H16 / 4 in fp64 on `device`, made once (no host-to-device copy per quantize)."""
    return hadamard_matrix().to(device)


def _strided(x: torch.Tensor, transposed: bool) -> tuple[int, int, int, int]:
    """(rows, cols, stride_r, stride_c) of the copy: x itself, or x.T read through swapped strides."""
    rows, cols = x.shape
    if transposed:
        return cols, rows, x.stride(1), x.stride(0)
    return rows, cols, x.stride(0), x.stride(1)


def _elem_emax(fmt: ElementFormat) -> int:
    return math.frexp(fmt.max)[1] - 1  # E4M3 8, E5M2 15, E2M1 2


def _quantize_copy(x: torch.Tensor, fmt: ElementFormat, layout: ScaleLayout, *, transposed: bool, hadamard: bool,
                   key: int | None, scale_rounding: str, encode_scale: torch.Tensor | None, stats: bool,
                   want_amax: bool, tensor_amax: torch.Tensor | None = None):
    """One copy (x, or x.T with `transposed`): (payload, scales, block amax or None, global decode scale or None,
    counts or None, NVFP4's tensor amax buffer or None). NVFP4 takes S_enc from `encode_scale`, else from
    `tensor_amax` (an amax pass already made over these very values), else from an amax pass of its own."""
    R, C, stride_r, stride_c = _strided(x, transposed)
    dev = x.device
    nvfp4 = layout.scale_format == ScaleFormat.E4M3
    packed = fmt is E2M1
    if packed and C % 2:
        raise ValueError(f"packed E2M1 needs an even number of columns, got {C}")
    if hadamard and C % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform runs in blocks of {HADAMARD_SIZE} along K, got K = {C}")
    if key is not None and not packed:
        raise NotImplementedError("stochastic rounding is offered for E2M1 elements only")
    if scale_rounding not in ("ceil", "floor"):
        raise ValueError(f"MX scale rounding {scale_rounding!r} is not 'ceil' or 'floor'")
    GR, GC = layout.block
    assert GR in (1, ROWS) and COLS % GC == 0, "a program's tile holds whole blocks (a 16x16 block row: all its rows)"
    scale_shape = layout.scale_shape(R, C)
    data = torch.empty((R, C // 2) if packed else (R, C), device=dev, dtype=torch.uint8 if packed else fmt.dtype)
    scale = torch.empty(scale_shape, device=dev, dtype=torch.float8_e4m3fn if nvfp4 else torch.uint8)
    amax = torch.empty(scale_shape, device=dev, dtype=torch.float32) if want_amax else None
    counts = torch.zeros(2, device=dev, dtype=torch.int64) if stats else None
    hmat = _hadamard_on(dev) if hadamard else scale  # fp64 (16, 16); a stand-in pointer without the transform
    grid = (triton.cdiv(R, ROWS), triton.cdiv(C, COLS))
    global_inv = tensor = None
    if nvfp4:
        global_inv = torch.empty((), device=dev, dtype=torch.float32)
        if encode_scale is not None:
            tensor = encode_scale.float().reshape(()).to(dev)
        elif tensor_amax is not None:
            tensor = tensor_amax
        else:
            tensor = torch.zeros((), device=dev, dtype=torch.float32)
            _microscaled_amax_kernel[grid](x, tensor.view(torch.int32), hmat, R, C, stride_r, stride_c,
                                           HADAMARD=hadamard, BR=ROWS, BC=COLS, num_warps=WARPS)
    dummy = scale  # stands in for pointers a variant does not touch
    _microscaled_cast_kernel[grid](
        x, data.view(torch.uint8), scale.view(torch.uint8), amax if amax is not None else dummy,
        counts if counts is not None else dummy, 0 if key is None else key, hmat,
        tensor if tensor is not None else dummy, global_inv if global_inv is not None else dummy,
        R, C, stride_r, stride_c, *scale_shape,
        NVFP4=nvfp4, PACKED=packed, FP8_DTYPE=tl.uint8 if packed else triton_fp8_dtype(fmt.dtype),
        ELEM_MAX=fmt.max, ELEM_EMAX=_elem_emax(fmt), MBITS=fmt.mantissa_bits, EMIN=fmt.min_normal_exponent,
        SATURATION=fmt.saturation_threshold, FLUSH=fmt.flush_threshold, FLOOR=scale_rounding == "floor",
        OWN_ENCODE_SCALE=nvfp4 and encode_scale is None, ONE_SIXTH=_ONE_SIXTH, HADAMARD=hadamard,
        STOCHASTIC=key is not None, STATS=stats, WRITE_AMAX=want_amax, SOFTWARE_ROUNDING=_interpreting(),
        GR=GR, GC=GC, BR=ROWS, BC=COLS, num_warps=WARPS)
    return data, scale, amax, global_inv, counts, tensor if nvfp4 and encode_scale is None else None


def quantize_microscaled_triton(x: torch.Tensor, fmt: ElementFormat, layout: ScaleLayout, *, transpose: bool = False,
                                hadamard_transposed: bool = False, key: int | None = None,
                                scale_rounding: str = "ceil", encode_scale: torch.Tensor | None = None,
                                stats: bool = False) -> tuple[QuantizedTensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of microscaling.quantize_microscaled: same arguments, same return, same bits. Launches: the row
    copy's cast (after an amax pass for NVFP4 without `encode_scale`), and with `transpose` the transposed copy's
    (after an amax pass of the transformed copy for NVFP4 with `hadamard_transposed`)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_microscaled takes a 2-D tensor, got shape {tuple(x.shape)}")
    if layout.scale_format != ScaleFormat.E8M0 and (layout.scale_format != ScaleFormat.E4M3 or fmt is not E2M1):
        raise ValueError(f"no microscaled quantizer for {fmt.name} elements in layout {layout.name}")
    rows, cols = x.shape
    data, scale, amax, global_inv, counts, tensor_amax = _quantize_copy(
        x, fmt, layout, transposed=False, hadamard=False, key=key, scale_rounding=scale_rounding,
        encode_scale=encode_scale, stats=stats, want_amax=True)
    result = QuantizedTensor((rows, cols), fmt, layout, data, scale, global_scale_inv=global_inv)
    if transpose:
        # Without the transform the transposed copy's S_enc is the row copy's (x.T has x's amax, or the agreed
        # S_enc), so a 16x16 layout gives the very bytes of the twin's relayout; with it, the transformed copy's own
        # amax (the transform moves mass between elements, TE).
        data_t, scale_t, _, global_t, _, _ = _quantize_copy(
            x, fmt, layout, transposed=True, hadamard=hadamard_transposed, key=transposed_key(key),
            scale_rounding=scale_rounding, encode_scale=None if hadamard_transposed else encode_scale, stats=False,
            want_amax=False, tensor_amax=None if hadamard_transposed else tensor_amax)
        result.data_t, result.scale_inv_t, result.global_scale_inv_t = data_t, scale_t, global_t
    return result, amax, counts


__all__ = ["COLS", "ROWS", "WARPS", "quantize_microscaled_triton"]
