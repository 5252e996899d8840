"""log2 and exp2 in fp64 from IEEE-rounded +, -, x, / and exact bit operations: the same bits in torch and in Triton;
and a correctly rounded fp64 square root on torch's CPU build (``sqrt``).

Why: the FP8 moment codec (megafp8.optim.state_codec) raises values to non-integer powers. Library ``log`` and ``pow``
differ in the last bit between torch's CPU build (SLEEF), numpy (what Triton's interpreter runs) and CUDA's libdevice,
so a fused kernel could not reproduce the codec's bits. Written out as a range reduction and a polynomial, every step
is a correctly rounded basic operation, which every IEEE implementation computes alike: torch on any device, Triton
interpreted, and Triton compiled (launched with ``enable_fp_fusion=False``: no multiply-add is fused behind our back).
In fp64 the results are within ~1e-11 relative of the true values, so the codec's fp32 results are the correctly
rounded ones but in rare ties of a last bit: accuracy is fp32's, reproducibility is exact.

    log2(x) = e + s * P(s^2)     x = 2^e m, m in [sqrt(1/2), sqrt(2)), s = (m - 1) / (m + 1), |s| < 0.172
                                 (ln m = 2 atanh s: P's coefficients are 2 / (ln 2 (2i + 1)), 7 terms)
    exp2(t) = Q(f) * 2^n         n = floor(t + 1/2), f = t - n in [-1/2, 1/2], for t in [-1022, 1023]
                                 (Q: the Taylor series of 2^f, 10 terms)

Polynomials run by Horner's rule, a multiply then an add per term. The Triton versions (reproducible_math_triton.py)
read their coefficients from ``constants(device)``: a Python float literal in a Triton kernel is an fp32 constant.
"""
from __future__ import annotations

import math

import torch


LOG2_COEFFS = tuple(2 / math.log(2) / (2 * i + 1) for i in range(7))
EXP2_COEFFS = tuple(math.log(2) ** i / math.factorial(i) for i in range(10))
LOG2_AT, EXP2_AT = 0, len(LOG2_COEFFS)  # where each polynomial's coefficients sit in ``constants()``
SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # fp64 bits of sqrt(1/2) (nearest): where the log's mantissa range starts

_constants: dict[torch.device, torch.Tensor] = {}


def constants(device: torch.device | str) -> torch.Tensor:
    """The polynomials' coefficients as an fp64 tensor on ``device`` (made once per device)."""
    device = torch.device(device)
    if device not in _constants:
        _constants[device] = torch.tensor(LOG2_COEFFS + EXP2_COEFFS, dtype=torch.float64, device=device)
    return _constants[device]


def log2_(x: torch.Tensor) -> torch.Tensor:
    """log2 of positive, finite fp64 values, computed in ``x``'s memory (other inputs give unspecified finite or NaN
    values). In place because the optimizer's twin runs it on 4M-element slabs: a few such tensors live at once."""
    bits = x.view(torch.int64)
    e = (bits - SQRT_HALF_BITS).bitwise_right_shift_(52)
    f = bits.sub_(e << 52).view(torch.float64).sub_(1.0)  # m - 1, m = x / 2^e (exact) in [sqrt(1/2), sqrt(2))
    s = f.div_(f + 2.0)
    z = s * s
    p = (z * LOG2_COEFFS[-1]).add_(LOG2_COEFFS[-2])
    for c in reversed(LOG2_COEFFS[:-2]):
        p.mul_(z).add_(c)
    del z
    return s.mul_(p).add_(e)  # e + s p; e (int64) converts exactly


def exp2_(t: torch.Tensor) -> torch.Tensor:
    """2^t for fp64 ``t`` in [-1022, 1023]; ``t`` is overwritten (its memory holds a temporary)."""
    n = (t + 0.5).floor_()
    f = t.sub_(n)  # exact
    q = (f * EXP2_COEFFS[-1]).add_(EXP2_COEFFS[-2])
    for c in reversed(EXP2_COEFFS[:-2]):
        q.mul_(f).add_(c)
    return q.mul_(n.long().add_(1023).bitwise_left_shift_(52).view(torch.float64))


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp64 values from 2^-960 up (IEEE's, which math.sqrt and CUDA give; below,
    where the exact residual's products would underflow, and for 0, inf and NaN: torch's).

    torch's CPU ``sqrt`` is off by one last bit on some machines (SLEEF picks its code by CPU, whatever
    ATEN_CPU_CAPABILITY says): the global grad norm then differed between machines. One Newton step on its result with
    the residual ``x - y^2`` computed exactly (Dekker's split: ``y^2 = p + e`` exactly) lands on the correctly rounded
    root: a square root is never a midpoint between two doubles, and the step's own error (~2^-106 relative) is far
    below any root's distance from one but in cases too rare to meet."""
    if x.dtype != torch.float64:
        raise TypeError(f"reproducible_math.sqrt takes fp64 values (its exact split is fp64's), got {x.dtype}")
    y = x.sqrt()
    c = y * 134217729.0  # 2^27 + 1: y = hi + lo, each half of the significand
    hi = c - (c - y)
    lo = y - hi
    p = y * y
    e = ((hi * hi - p) + 2.0 * hi * lo) + lo * lo
    corrected = y + ((x - p) - e) / (2.0 * y)  # x - p is exact (Sterbenz: p is within a factor 2 of x)
    return torch.where((x >= 2.0 ** -960) & torch.isfinite(y), corrected, y)

