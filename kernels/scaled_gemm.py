"""scaled_gemm: the GEMM of two QuantizedTensors, dispatched on their declared (format, layout) pairs, never on shapes.

A pair with a kernel (today's FP8 scale modes, scaling.GemmScaleMode) runs fp8_gemm with its layouts declared; a
pair without one (a format added before its kernel, e.g. a test-only recipe) runs the dequantize-then-fp32-matmul
twin, which is what a kernel for it must match bit for bit on exact products.
"""
from __future__ import annotations

import torch

from .dispatch import fp8_gemm
from .quantized_tensor import QuantizedTensor
from .scaling import GemmScaleMode


def has_kernel(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether an FP8 GEMM kernel exists for these operands' (format, layout) pairs."""
    try:
        GemmScaleMode.declared(a.layout, b.layout)
    except ValueError:
        return False
    return a.format.bits == 8 and b.format.bits == 8


def scaled_gemm(a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, accumulate: bool = False, fast_accum: bool = False) -> torch.Tensor:
    """C (M, N) = A @ B.T from the row-major copies of A (M, K) and B (N, K) [+ bias] [+ out if accumulate].
    Use `b.t()` for an operand's transposed copy. `fast_accum` is the caller's choice for fprop (tensorwise/rowwise)."""
    (data_a, scale_a), (data_b, scale_b) = a.row_major(), b.row_major()
    if has_kernel(a, b):
        return fp8_gemm(data_a, data_b, scale_a, scale_b, out_dtype=out_dtype, bias=bias, out=out,
                        accumulate=accumulate, fast_accum=fast_accum, layouts=(a.layout, b.layout))
    return scaled_gemm_reference(a, b, out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate)


def scaled_gemm_reference(a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype,
                          bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          accumulate: bool = False) -> torch.Tensor:
    """The twin of any layout pair: both operands dequantized to fp32, one fp32 matmul (gemm_reference's rule)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_gemm wants A (M, K) and B (N, K) with the same K, got {a.shape} and {b.shape}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs `out`, the buffer to accumulate into")
    c = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        c += bias.float()
    if accumulate:
        c += out.float()
    return c.to(out_dtype) if out is None else out.copy_(c)
