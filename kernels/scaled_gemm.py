"""scaled_gemm: the GEMM of two QuantizedTensors, dispatched on their declared (format, layout) pairs, never on shapes.

A pair with a kernel (today's FP8 scale modes, scaling.GemmScaleMode) runs fp8_gemm with its layouts declared; a
microscaled pair (MXFP8, MXFP4, NVFP4) on CUDA runs the block-scaled Triton GEMM (block_scaled_gemm.py: tl.dot_scaled,
native on sm_100a, a BF16 upcast on Hopper); a pair without a kernel (a format added before its kernel, e.g. a
test-only recipe, or a microscaled pair on CPU) runs the dequantize-then-fp32-matmul twin, which is what a kernel
for it must match bit for bit on exact products.
"""
from __future__ import annotations

import torch

from .dispatch import fp8_gemm, resolve_backend
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
    if a.is_microscaled and b.is_microscaled and resolve_backend(data_a.device) == "triton":
        return _block_scaled(a, b, out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate)
    if has_kernel(a, b):
        return fp8_gemm(data_a, data_b, scale_a, scale_b, out_dtype=out_dtype, bias=bias, out=out,
                        accumulate=accumulate, fast_accum=fast_accum, layouts=(a.layout, b.layout))
    return scaled_gemm_reference(a, b, out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate)


def _block_scaled(a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype, bias: torch.Tensor | None,
                  out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """The block-scaled Triton GEMM in fp32; bias, accumulation and the output dtype applied after it (its epilogue
    has none of them)."""
    from .block_scaled_gemm import block_scaled_gemm_triton  # Triton is imported only where it is used

    if accumulate and out is None:
        raise ValueError("accumulate=True needs `out`, the buffer to accumulate into")
    c = block_scaled_gemm_triton(a, b, out_dtype=torch.float32)
    if bias is not None:
        c += bias.float()
    if accumulate:
        c += out.float()
    return c.to(out_dtype) if out is None else out.copy_(c)


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
