"""Torch reference twin of the grouped FP8 GEMM: one fp8_gemm_reference per group on its rows (dequantize, fp32
matmul), the loop of GEMMs an MoE layer runs without grouping, so on CPU the grouped path is that loop to the bit."""
from __future__ import annotations

import torch

from .gemm_reference import fp8_gemm_reference
from .scaling import GemmScaleMode


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
