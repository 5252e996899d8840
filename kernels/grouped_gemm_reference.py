"""Torch reference twins of the grouped FP8 GEMMs: one fp8_gemm_reference per group on its rows (fprop, dgrad) or on
its columns (wgrad), the loop of GEMMs an MoE layer runs without grouping, so on CPU the grouped path is that loop to
the bit."""
from __future__ import annotations

import torch

from .gemm_reference import fp8_gemm_reference
from .scaling import BLOCK, GemmScaleMode


def grouped_fp8_gemm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                               group_ends: torch.Tensor, mode: GemmScaleMode,
                               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C (M, N): rows ``[ends[g-1], ends[g])`` of A times group g's B (N, K), transposed (arguments: grouped_gemm)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    start = 0
    for group, end in enumerate(group_ends.tolist()):  # the twin reads the row counts on the host, as the loop does
        if end > start:
            out[start:end] = fp8_gemm_reference(a[start:end], b[group], scale_a[start:end], scale_b[group],
                                                out_dtype=out_dtype, layouts=mode.operand_layouts)
        start = end
    return out


def grouped_fp8_wgrad_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                                group_sizes: torch.Tensor, mode: GemmScaleMode) -> torch.Tensor:
    """C[g] (M, N) fp32: group g's ``sizes[g]`` columns of A (M, K) times those of B (N, K), transposed (arguments:
    grouped_gemm.grouped_fp8_wgrad); the zero columns padding each group to a multiple of 128 are left out."""
    out = a.new_empty((group_sizes.numel(), a.shape[0], b.shape[0]), dtype=torch.float32)
    start = 0
    for group, size in enumerate(group_sizes.tolist()):
        columns = slice(start, start + size)
        if mode == GemmScaleMode.BLOCKWISE_1X128:  # the groups' token groups, along the padded columns
            groups = slice(start // BLOCK, -(-(start + size) // BLOCK))
            scales = (scale_a[:, groups], scale_b[:, groups])
        else:
            scales = (scale_a[group], scale_b[group])
        if size:
            out[group] = fp8_gemm_reference(a[:, columns], b[:, columns], *scales, layouts=mode.operand_layouts)
        else:
            out[group] = 0.0
        start += -(-size // BLOCK) * BLOCK
    return out
