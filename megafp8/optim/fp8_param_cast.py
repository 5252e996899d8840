"""Casting a DP rank's shard of an FP8 layer's weight straight to FP8, with the scales every shard agrees on.

A shard is a flat range ``[lo, hi)`` of the row-major weight ``(rows, cols)``. The weight role's
scaling groups (``recipe.granularity("weight")``) are numbered row-major over the scale tensor's shape
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

from megafp8_kernels import Granularity, fp8_format, scale_shape
from megafp8_kernels.quantize_reference import reciprocal, saturating_cast

BLOCK = 128


def num_scale_groups(shape: tuple[int, int], gran: Granularity) -> int:
    return math.prod(scale_shape(shape[0], shape[1], gran))


def group_index(lo: int, hi: int, shape: tuple[int, int], gran: Granularity, device=None) -> torch.Tensor | None:
    """The scaling group of each element of the flat range ``[lo, hi)`` (None: a single group)."""
    if gran is Granularity.TENSORWISE:
        return None
    cols = shape[1]
    idx = torch.arange(lo, hi, device=device)
    rows = idx // cols
    if gran is Granularity.ROWWISE:
        return rows
    if gran is Granularity.BLOCK_128X128:
        return (rows // BLOCK) * math.ceil(cols / BLOCK) + (idx % cols) // BLOCK
    raise ValueError(f"weights are not quantized with {gran.value} groups")


def accumulate_group_amax(amax: torch.Tensor, values: torch.Tensor, groups: torch.Tensor | None) -> None:
    """amax[g] = max(amax[g], |values in group g|), in place."""
    a = values.abs().float()
    if groups is None:
        torch.maximum(amax, a.amax().reshape(1), out=amax)
    else:
        amax.scatter_reduce_(0, groups, a, reduce="amax")


def cast_to_fp8(values: torch.Tensor, scale: torch.Tensor, groups: torch.Tensor | None,
                fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of ``values`` with per-group quantization ``scale`` (flat, one per group)."""
    per_element = scale.reshape(()) if groups is None else scale[groups]
    return saturating_cast(values.float() * per_element, fp8_format(fp8_dtype)).view(torch.uint8)


def scale_inv_for(scale: torch.Tensor, shape: tuple[int, int], gran: Granularity) -> torch.Tensor:
    """The layer-facing dequantization scales in the granularity's shape."""
    return reciprocal(scale).reshape(scale_shape(shape[0], shape[1], gran))
