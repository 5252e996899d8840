"""Stochastic rounding of fp32 values to fp16, driven by a counter-based hash of (key, element index), so the
rounding of one element is a pure function of the run's seed, the step, the parameter and its own flat index:
reproducible on resume and independent of how DP shards or chunks the parameter.

Why: the fp16 master weight's grid step is 2^-10 of the value's binade (2^-11 just below a power of two); an
AdamW step below half of it rounds away under round-to-nearest, forever. Rounding up with probability
``(x - lo) / (hi - lo)`` (``lo <= x <= hi`` the two neighbouring fp16 values) makes every encode unbiased,
``E[round(x)] = x``, so small steps accumulate in expectation; the price is rounding noise (variance at most
``(hi - x)(x - lo)`` per step) instead of a systematic stall.
"""
from __future__ import annotations

import zlib

import torch

_MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 24  # an fp32 holds a 24-bit integer exactly, so u = k / 2^24 is exact
FP16_MAX = 65504.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on int64 tensors holding 32-bit values (products wrap in
    int64; only their low 32 bits are kept, which two's-complement wrapping leaves exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int, name: str) -> int:
    """A 32-bit key for one parameter's encode at one step (``name`` salts parameters apart)."""
    return _mix32_int(_mix32_int(_mix32_int(seed) ^ step) ^ zlib.crc32(name.encode()))


def rounding_keys(seed: int, step: torch.Tensor, name_salts: torch.Tensor) -> torch.Tensor:
    """``rounding_key`` on the device: ``step`` an int64 tensor, ``name_salts`` the names' crc32 (int64)."""
    return _mix32(_mix32(_mix32_int(seed) ^ step) ^ name_salts)


def counter_uniform(key: int, start: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for elements ``[start, start + n)``: ``hash(key, index)``, one per index."""
    return counter_uniform_at(torch.tensor(key, dtype=torch.int64, device=device),
                              torch.arange(start, start + n, dtype=torch.int64, device=device))


def counter_uniform_at(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``counter_uniform`` at arbitrary flat indices (int64), with int64 keys broadcast against them: the
    optimizer draws a whole shard's uniforms at once, each element keyed by its parameter's key."""
    h = _mix32((index & _MASK32) ^ key)
    h = _mix32(h ^ (index >> 32) ^ _mix32(key ^ 0x9E3779B9))
    return (h >> (32 - UNIFORM_BITS)).to(torch.float32) * 2.0 ** -UNIFORM_BITS


def stochastic_round_to_fp16(values: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``values`` (fp32) rounded to one of their two fp16 neighbours, up with probability ``(x - lo) / (hi - lo)``
    (``uniform`` in [0, 1), one per element). Exact values stay exact; beyond fp16's largest finite value
    (65504) a finite value saturates there; inf and NaN pass through."""
    x = values.float()
    x = torch.where(torch.isfinite(x), x.clamp(-FP16_MAX, FP16_MAX), x)
    nearest = x.to(torch.float16)
    below = nearest.float() <= x
    lo = torch.where(below, nearest, torch.nextafter(nearest, torch.full_like(nearest, -float("inf"))))
    hi = torch.where(below, torch.nextafter(nearest, torch.full_like(nearest, float("inf"))), nearest)
    # x - lo is exact in fp32 (Sterbenz: lo <= x <= 2 lo in magnitude, or both tiny) and hi - lo is a power of two.
    p_up = (x - lo.float()) / (hi.float() - lo.float())
    rounded = torch.where(uniform < p_up, hi, lo)
    return torch.where(torch.isfinite(p_up), rounded, nearest)
