"""Torch reference twin of the Triton quantization kernels: the oracle in tests and the CPU execution path.

The rules every backend follows bit for bit:
  scale     = FP8_MAX / amax, with amax == 0 -> 1, an infinite quotient clamped to FLOAT32_MAX,
              optionally rounded down to a power of two, and NaN when amax is not finite (a NaN or
              inf in a scaling group makes that whole group dequantize to NaN: loud, never hidden);
  scale_inv = 1 / scale;
  fp8       = round-to-nearest-even(clamp(x * scale, -FP8_MAX, FP8_MAX)), NaN stays NaN and an inf
              becomes NaN: finite values past the range saturate, but an inf is an overflow that already
              happened, and clamping it to FP8_MAX (as a given, delayed scale would) would hide it.
"""
from __future__ import annotations

import torch

from .formats import WHOLE, ScaleLayout, scale_layout
from .scaling import (
    FLOAT32_MAX,
    Fp8Format,
    Fp8Quantized,
    Granularity,
    check_quantize_args,
    granularity,
    to_scale_layout,
)

_EXPONENT_MASK = 0x7F800000


def scale_from_amax(amax: torch.Tensor, fp8_max: float, power_of_2_scale: bool) -> torch.Tensor:
    """Current-scaling rule (see module docstring); amax is fp32 of any shape."""
    scale = torch.full_like(amax, fp8_max) / amax  # a true division: `python_float / t` is not IEEE
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.clamp(scale, max=FLOAT32_MAX)
    if power_of_2_scale:  # clear the mantissa: round down to a power of two, exact to invert
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """IEEE 1/scale. (`1.0 / t` computes reciprocal(t) * 1.0 in torch, which is off by an ulp at times.)"""
    return torch.ones_like(scale) / scale


def saturating_cast(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 -> FP8 with round-to-nearest-even; finite values past the range saturate, NaN stays NaN, inf -> NaN."""
    return saturating_cast_(y.clone(), fmt)


def saturating_cast_(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """saturating_cast overwriting its fp32 input (no temporary of its size: for casts of large slabs)."""
    return y.masked_fill_(torch.isinf(y), float("nan")).clamp_(-fmt.max, fmt.max).to(fmt.dtype)  # clamp keeps NaN


def _group_amax(a: torch.Tensor, gran: Granularity | ScaleLayout) -> torch.Tensor:
    """Per-group max of |x| (NaN-propagating), in the layout's scale shape: any block layout, read from its block
    shape (a max is exact in any order, so one rule serves every layout bit for bit)."""
    layout = scale_layout(gran)
    if layout.block == (WHOLE, WHOLE):
        return a.amax()
    rows, cols = a.shape
    edge_rows, edge_cols = _edges(layout, rows, cols)
    padded = torch.nn.functional.pad(a, (0, -cols % edge_cols, 0, -rows % edge_rows))
    return padded.view(padded.shape[0] // edge_rows, edge_rows, -1, edge_cols).amax(dim=(1, 3))


def _edges(layout: ScaleLayout, rows: int, cols: int) -> tuple[int, int]:
    block_rows, block_cols = layout.block
    return (rows if block_rows == WHOLE else block_rows), (cols if block_cols == WHOLE else block_cols)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, gran: Granularity | ScaleLayout) -> torch.Tensor:
    """Broadcast per-group scales of any block layout to a (rows, cols) elementwise tensor."""
    block_rows, block_cols = scale_layout(gran).block
    if block_rows not in (WHOLE, 1):
        scale = scale.repeat_interleave(block_rows, dim=0)[:rows]
    if block_cols != WHOLE:
        scale = scale.repeat_interleave(block_cols, dim=1)[:, :cols]
    return scale.expand(rows, cols)


def cast_counts(x32: torch.Tensor, scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """int64 [saturated, flushed] of one cast of x32 (scaled = x32 * scale): |scaled| past the saturation
    threshold, and nonzero inputs that round to +-0 (|scaled| <= half the smallest subnormal; ties go to the
    even 0, a NaN is neither). The Triton kernel counts the same per tile, on the FP8 bits it writes."""
    magnitude = scaled.abs()
    flags = torch.stack([magnitude > fmt.saturation_threshold, (magnitude <= fmt.flush_threshold) & (x32 != 0)])
    return flags.sum(dim=(1, 2))


def _quantize_groups(x32: torch.Tensor, fmt: Fp8Format, gran: Granularity, power_of_2_scale: bool,
                     stats: bool = False):
    rows, cols = x32.shape
    amax = _group_amax(x32.abs(), gran)
    scale = scale_from_amax(amax, fmt.max, power_of_2_scale)
    scaled = x32 * expand_scale(scale, rows, cols, gran)
    counts = cast_counts(x32, scaled, fmt) if stats else None
    return Fp8Quantized(saturating_cast(scaled, fmt), to_scale_layout(reciprocal(scale), gran),
                        to_scale_layout(amax, gran), counts=counts)


def quantize_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity_: str | Granularity = Granularity.TENSORWISE,
    *,
    power_of_2_scale: bool = False,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    stats: bool = False,
) -> Fp8Quantized:
    """Quantize a 2-D tensor to FP8 with current scaling, or with a given tensorwise `scale` (delayed).

    With transpose=True also returns the FP8 copy of x.T, whose groups run along x's rows. With stats=True
    also the counts of saturated and flushed elements of the row-major cast (Fp8Quantized.counts).
    """
    gran = granularity(granularity_)
    fmt = check_quantize_args(x, fp8_dtype, gran, scale)
    x32 = x.float()
    if scale is not None:
        scale = scale.reshape(())
        scaled = x32 * scale
        counts = cast_counts(x32, scaled, fmt) if stats else None
        result = Fp8Quantized(saturating_cast(scaled, fmt), reciprocal(scale), x32.abs().amax(), counts=counts)
    else:
        result = _quantize_groups(x32, fmt, gran, power_of_2_scale, stats)
    if not transpose:
        return result
    if scale_layout(gran).transpose_is_relayout:
        # Same groups, same scales (one scale, square tiles): the transposed copy is the same bytes, moved.
        # clone, not contiguous(): a 0-dim scale's transpose is itself, and outputs must not alias.
        return result._replace(data_t=result.data.t().contiguous(),
                               scale_inv_t=result.scale_inv.t().clone(memory_format=torch.contiguous_format))
    transposed = _quantize_groups(x32.t(), fmt, gran, power_of_2_scale)
    return result._replace(data_t=transposed.data.contiguous(), scale_inv_t=transposed.scale_inv)
