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

import torch

# The hash lives with the kernels, which draw from it too; re-exported for the optimizer and its tests.
from megafp8_kernels.counter_hash import (  # noqa: F401
    UNIFORM_BITS,
    counter_uniform,
    counter_uniform_at,
    rounding_key,
    rounding_keys,
)

FP16_MAX = 65504.0


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
