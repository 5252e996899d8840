"""Torch reference twin of the Triton FP8 GEMM: dequantize to fp32, fp32 matmul (no bf16 matmuls on CPU)."""
from __future__ import annotations

import torch

from .formats import ScaleLayout
from .quantize_reference import expand_scale
from .scaling import check_gemm_args


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, granularity) -> torch.Tensor:
    """FP8 data and its per-group dequantization scales (a Granularity or any ScaleLayout) -> fp32."""
    rows, cols = data.shape
    return data.float() * expand_scale(scale_inv, rows, cols, granularity)


def fp8_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    layouts: tuple[ScaleLayout | str, ScaleLayout | str] | None = None,
) -> torch.Tensor:
    """C (M, N) = (A * scale_a) @ (B * scale_b).T [+ bias] [+ out if accumulate], accumulated in fp32.

    A (M, K) and B (N, K) are FP8 and K-major; scale_a/scale_b are dequantization scales in the declared (A, B)
    `layouts`, which pick the mode (see scaling.GemmScaleMode; undeclared: guessed from the scale shapes).
    With `out` the result is written there and returned.
    """
    mode = check_gemm_args(a, b, scale_a, scale_b, out_dtype, bias, out, accumulate, layouts)
    gran_a, gran_b = mode.operand_granularities
    c = dequantize(a, scale_a, gran_a) @ dequantize(b, scale_b, gran_b).t()
    if bias is not None:
        c += bias.float()
    if accumulate:
        c += out.float()
    if out is None:
        return c.to(out_dtype)
    return out.copy_(c)
