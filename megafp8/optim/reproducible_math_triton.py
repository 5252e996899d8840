"""megafp8.optim.reproducible_math's log2 and exp2 as Triton functions for the fused optimizer kernels: the same bits
as its torch versions (its docstring says how)."""
from __future__ import annotations

import triton
import triton.language as tl

from megafp8.optim.reproducible_math import EXP2_AT, EXP2_COEFFS, LOG2_AT, LOG2_COEFFS, SQRT_HALF_BITS

_SQRT_HALF_BITS = tl.constexpr(SQRT_HALF_BITS)
_LOG2_AT, _LOG2_TERMS = tl.constexpr(LOG2_AT), tl.constexpr(len(LOG2_COEFFS))
_EXP2_AT, _EXP2_TERMS = tl.constexpr(EXP2_AT), tl.constexpr(len(EXP2_COEFFS))


@triton.jit
def log2_fp64(x, consts_ptr):
    """``log2_`` on an fp64 tile; ``consts_ptr``: ``constants(device)``."""
    bits = x.to(tl.int64, bitcast=True)
    e = (bits - _SQRT_HALF_BITS) >> 52
    m = (bits - (e << 52)).to(tl.float64, bitcast=True)
    f = m - 1.0
    s = f / (f + 2.0)  # fp64 division is IEEE in Triton (div.rn.f64); div_rn is fp32's
    z = s * s
    p = z * tl.load(consts_ptr + _LOG2_AT + _LOG2_TERMS - 1) + tl.load(consts_ptr + _LOG2_AT + _LOG2_TERMS - 2)
    for i in tl.static_range(_LOG2_TERMS - 3, -1, -1):
        p = p * z + tl.load(consts_ptr + _LOG2_AT + i)
    return s * p + e.to(tl.float64)

@triton.jit
def exp2_fp64(t, consts_ptr):
    """``exp2_`` on an fp64 tile; ``consts_ptr``: ``constants(device)``."""
    n = tl.floor(t + 0.5)
    f = t - n
    q = f * tl.load(consts_ptr + _EXP2_AT + _EXP2_TERMS - 1) + tl.load(consts_ptr + _EXP2_AT + _EXP2_TERMS - 2)
    for i in tl.static_range(_EXP2_TERMS - 3, -1, -1):
        q = q * f + tl.load(consts_ptr + _EXP2_AT + i)
    return q * ((n.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
