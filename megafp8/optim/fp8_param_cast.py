"""Casting a DP rank's shard of an FP8 layer's weight straight to FP8, with the scales every shard agrees on.

A shard is a flat range ``[lo, hi)`` of the row-major weight ``(rows, cols)``. The weight role's
scaling groups (the layout of ``recipe.quantizer("weight")``) are numbered row-major over the scale tensor's shape
(``megafp8_kernels.scale_shape``): tensorwise has one group, rowwise one per row, blockwise 128x128 one
per block. A shard may cut a group; every owner then contributes its part of the group's amax and one
MAX all-reduce over DP (of all groups of all FP8 weights, batched) gives every rank the whole-tensor
scale, so the gathered bytes are exactly the bytes of quantizing the full weight on one rank. Under
delayed scaling the scale is the weight role's synchronized ``ScalingState.scale`` and no reduction is
needed. The cast reproduces megafp8_kernels' reference rule (``saturating_cast(x * scale)``).
"""
from __future__ import annotations

import math

import torch

from megafp8_kernels import Granularity, ScaleLayout, fp8_format, scale_layout, scale_shape
from megafp8_kernels.formats import WHOLE as WHOLE_DIM
from megafp8_kernels.quantize_reference import saturating_cast_

WHOLE = 1 << 62  # a divisor no flat index reaches: the quotient is 0 (one group along that dimension)


def num_scale_groups(shape: tuple[int, int], gran: Granularity) -> int:
    return math.prod(scale_shape(shape[0], shape[1], gran))


def group_divisors(shape: tuple[int, int], gran: Granularity | ScaleLayout) -> tuple[int, int, int]:
    """(row divisor, groups per row band, column divisor): element (r, c) of a weight of this shape is in
    group ``(r // row_div) * per_band + c // col_div``, the row-major numbering of ``scale_shape``; read from the
    layout's block shape, so any block layout works (a block edge spanning the dimension divides by WHOLE)."""
    block_rows, block_cols = scale_layout(gran).block
    row_div = WHOLE if block_rows == WHOLE_DIM else block_rows
    col_div = WHOLE if block_cols == WHOLE_DIM else block_cols
    return row_div, 1 if col_div == WHOLE else -(-shape[1] // col_div), col_div


def element_groups(flat_index: torch.Tensor, cols, row_div, per_band, col_div) -> torch.Tensor:
    """The scaling group of each element from its flat (row-major) index, which it overwrites (in place: the
    publication's slabs are large); the shape constants are ``group_divisors`` values broadcasting against it."""
    rows = torch.div(flat_index, cols, rounding_mode="floor")
    col = flat_index.remainder_(cols)
    return rows.div_(row_div, rounding_mode="floor").mul_(per_band).add_(col.div_(col_div, rounding_mode="floor"))


def cast_to_fp8(values: torch.Tensor, per_element_scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of fp32 ``values`` (overwritten) times their quantization scale: megafp8_kernels'
    ``saturating_cast`` rule (inf -> NaN, saturate, round to nearest even), in place."""
    return saturating_cast_(values.mul_(per_element_scale), fp8_format(fp8_dtype)).view(torch.uint8)
