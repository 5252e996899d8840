"""The Triton kernels of megafp8.optim.fused_adamw_coded (beside their twins and launchers there), imported at the
first fused step rather than at every process's start."""
from __future__ import annotations

import triton
import triton.language as tl

from megafp8.optim.reproducible_math_triton import exp2_fp64, log2_fp64
from megafp8.optim.state_codec import E4M3_MAX, K_MAX
from megafp8_kernels.counter_hash_triton import counter_uniform_triton

_counter_uniform = counter_uniform_triton  # the name the twin tests probe

_E4M3_MAX, _K_MAX = tl.constexpr(E4M3_MAX), tl.constexpr(K_MAX)

@triton.jit
def _bf16_bits_to_fp32(bits):
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)

@triton.jit
def _fp32_to_bf16_bits(x):  # round to nearest even, as torch's cast (finite values)
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)

@triton.jit
def _e4m3_bits(y):
    """fp32 ``y``, |y| <= 448, to its E4M3 byte, rounded to nearest even (torch's cast) in integer steps."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # y's binade; E4M3's subnormals share 2^-6's spacing
    steps = magnitude * ((130 - e) << 23).to(tl.float32, bitcast=True)  # |y| / 2^(e - 3), exact: in [0, 16]
    steps = (steps + 12582912.0) - 12582912.0  # + 1.5 * 2^23: fp32 addition rounds to an even integer
    code = (e + 6) * 8 + steps.to(tl.int32)  # a carry into the next binade is the next exponent field
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)

@triton.jit
def _stochastic_round_to_fp16(x, uniform):
    """stochastic_rounding.stochastic_round_to_fp16, with torch.nextafter on fp16 written on the bits."""
    finite = tl.abs(x) < float("inf")
    x = tl.where(finite, tl.minimum(tl.maximum(x, -65504.0), 65504.0), x)
    nearest = x.to(tl.float16)
    bits = nearest.to(tl.int16, bitcast=True).to(tl.int32)
    zero, negative = (bits & 0x7FFF) == 0, bits < 0
    up = tl.where(zero, 1, tl.where(negative, bits - 1, bits + 1))  # towards +inf (from +-0: +2^-24)
    down = tl.where(zero, -32767, tl.where(negative, bits + 1, bits - 1))  # towards -inf (-2^-24 is 0x8001)
    below = nearest.to(tl.float32) <= x
    lo = tl.where(below, bits, down).to(tl.int16).to(tl.float16, bitcast=True)
    hi = tl.where(below, up, bits).to(tl.int16).to(tl.float16, bitcast=True)
    p_up = tl.math.div_rn(x - lo.to(tl.float32), hi.to(tl.float32) - lo.to(tl.float32))
    rounded = tl.where(uniform < p_up, hi, lo)
    return tl.where(tl.abs(p_up) < float("inf"), rounded, nearest)

@triton.jit
def _decode_moment(ptr, amax_ptr, k_ptr, offs, group, inside, row_in, math_ptr, table_ptr, STATE: tl.constexpr):
    if STATE == 2:  # state_codec.fp8_decode_groups
        code = tl.load(ptr + offs, mask=inside, other=0).to(tl.int32)
        amax = _bf16_bits_to_fp32(tl.load(amax_ptr + group, mask=row_in, other=0)).to(tl.float64)
        k = _bf16_bits_to_fp32(tl.load(k_ptr + group, mask=row_in, other=0x3F80)).to(tl.float64)
        t = tl.maximum(tl.load(table_ptr + (code & 0x7F)) / k[:, None], -1000.0)
        magnitude = (exp2_fp64(t, math_ptr) * amax[:, None]).to(tl.float32)
        return tl.where(code >= 0x80, -magnitude, magnitude)
    elif STATE == 1:
        return _bf16_bits_to_fp32(tl.load(ptr + offs, mask=inside, other=0))
    else:
        return tl.load(ptr + offs, mask=inside, other=0.0)

@triton.jit
def _store_moment(x, ptr, amax_ptr, k_ptr, offs, group, store, row_store, math_ptr, table_ptr,
                  STATE: tl.constexpr):
    """Encode ``x`` ([ROWS, GROUP] fp32); store its elements where ``store``, its groups' amax and k where
    ``row_store`` (the caller folds the finite flag into both)."""
    if STATE == 2:  # state_codec.fp8_encode_groups, per row
        a = tl.abs(x)
        amax = tl.max(a, axis=1)
        amax = ((amax.to(tl.int32, bitcast=True) + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)  # up to bf16
        amin = tl.min(tl.where(a > 0, a, float("inf")), axis=1)
        log_amax = log2_fp64(amax.to(tl.float64), math_ptr)
        log_ratio = log_amax - log2_fp64(amin.to(tl.float64), math_ptr)
        k = tl.where(log_ratio > 0, tl.load(table_ptr + 128) / log_ratio, _K_MAX)
        k = tl.where(amax > 0, tl.minimum(k, _K_MAX), 1.0).to(tl.float32)
        k = (k.to(tl.int32, bitcast=True) & -0x10000).to(tl.float32, bitcast=True)  # down to bf16
        t = (log2_fp64(a.to(tl.float64), math_ptr) - log_amax[:, None]) * k.to(tl.float64)[:, None]
        y = exp2_fp64(t, math_ptr) * _E4M3_MAX
        y = tl.where(a > 0, y, 0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.where(x < 0, -y, y), -_E4M3_MAX), _E4M3_MAX)
        tl.store(ptr + offs, _e4m3_bits(y), mask=store)
        tl.store(amax_ptr + group, (amax.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=row_store)
        tl.store(k_ptr + group, (k.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=row_store)
    elif STATE == 1:
        tl.store(ptr + offs, _fp32_to_bf16_bits(x), mask=store)
    else:
        tl.store(ptr + offs, x, mask=store)

@triton.jit
def _adamw_coded_kernel(g_ptr, grad_lo, start, n_groups, p_ptr, m_ptr, m_amax_ptr, m_k_ptr, v_ptr, v_amax_ptr,
                        v_k_ptr, decay_ptr, clip_ptr, finite_ptr, step_size_ptr, bc2_ptr, scale_ptr, key_ptr,
                        index_offset_ptr, group_amax_ptr, math_ptr, table_ptr, decay_factor, lerp_weight, beta2,
                        one_minus_beta2, eps, FP16_MASTER: tl.constexpr, STATE: tl.constexpr,
                        HAS_DECAY: tl.constexpr, HAS_CLIP: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                        ROWS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # groups of this launch
    row_in = rows < n_groups
    local = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [ROWS, GROUP_SIZE]
    inside = local < n_groups * GROUP_SIZE
    group = start // GROUP_SIZE + rows  # storage groups
    offs = start + local
    g = tl.load(g_ptr + grad_lo + local, mask=inside, other=0.0).to(tl.float32)
    if HAS_CLIP:
        g = g * tl.load(clip_ptr)
    p = tl.load(p_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if FP16_MASTER:
        scale = tl.load(scale_ptr + group, mask=row_in, other=1.0)[:, None]
        p = tl.math.div_rn(p, scale)
    m = _decode_moment(m_ptr, m_amax_ptr, m_k_ptr, offs, group, inside, row_in, math_ptr, table_ptr, STATE)
    v = _decode_moment(v_ptr, v_amax_ptr, v_k_ptr, offs, group, inside, row_in, math_ptr, table_ptr, STATE)
    if HAS_DECAY:
        decays = tl.load(decay_ptr + group, mask=row_in, other=0) != 0
        p = p * tl.where(decays, decay_factor, 1.0)[:, None]
    # The AdamW arithmetic of fused_adamw._adamw_fp32_kernel (torch's lerp and addcmul are fmas).
    if SMALL_WEIGHT:
        m = tl.fma(g - m, lerp_weight, m)
    else:
        m = tl.fma(g - m, lerp_weight - 1.0, g)
    v = tl.fma(g * one_minus_beta2, g, v * beta2)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(bc2_ptr)) + eps
    p = p + tl.math.div_rn(m * tl.load(step_size_ptr), denom)
    finite = tl.load(finite_ptr) != 0  # a non-finite step stores nothing: every value is kept
    store, row_store = tl.where(finite, inside, False), tl.where(finite, row_in, False)
    _store_moment(m, m_ptr, m_amax_ptr, m_k_ptr, offs, group, store, row_store, math_ptr, table_ptr, STATE)
    _store_moment(v, v_ptr, v_amax_ptr, v_k_ptr, offs, group, store, row_store, math_ptr, table_ptr, STATE)
    if FP16_MASTER:
        key = tl.load(key_ptr + group, mask=row_in, other=0)[:, None]
        index = offs + tl.load(index_offset_ptr + group, mask=row_in, other=0)[:, None]
        rounded = _stochastic_round_to_fp16(p * scale, counter_uniform_triton(key, index))
        tl.store(p_ptr + offs, rounded, mask=store)
        tl.store(group_amax_ptr + group, tl.max(tl.abs(p), axis=1), mask=row_in)
    else:
        tl.store(p_ptr + offs, p, mask=store)

@triton.jit
def _publish_fp16_master_kernel(codes_ptr, scale_ptr, group_lo, out_ptr, n, OUT_BF16: tl.constexpr,
                                BLOCK: tl.constexpr, GROUP_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    scale = tl.load(scale_ptr + group_lo + i // GROUP_SIZE, mask=inside, other=1.0)
    value = tl.math.div_rn(tl.load(codes_ptr + i, mask=inside, other=0.0).to(tl.float32), scale)
    if OUT_BF16:  # the interpreter's fp32 -> bf16 cast truncates
        value = _fp32_to_bf16_bits(value).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=inside)
