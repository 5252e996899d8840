"""One public function per op: Triton on CUDA tensors, the torch reference twin on CPU tensors.

Override with `backend=` or the environment variable MEGAFP8_KERNEL_BACKEND (auto | triton | reference);
tests force "triton" on CPU together with TRITON_INTERPRET=1 to run the real kernels in the interpreter.
"""
from __future__ import annotations

import os

import torch

from .gemm_reference import fp8_gemm_reference
from .quantize_reference import quantize_reference
from .scaling import Fp8Quantized, Granularity

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "MEGAFP8_KERNEL_BACKEND"


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """'triton' or 'reference' for tensors on `device`."""
    choice = backend or os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        source = "backend=" if backend else ENV_VAR
        raise ValueError(f"{source}{choice!r} is not a kernel backend: choose one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the Triton backend was requested for CPU tensors: set TRITON_INTERPRET=1 before importing "
            "megafp8_kernels to run the kernels in Triton's interpreter, or use the reference backend"
        )
    return choice


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str | Granularity = Granularity.TENSORWISE,
    *,
    power_of_2_scale: bool = False,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    backend: str | None = None,
) -> Fp8Quantized:
    """Quantize a 2-D tensor to FP8 (see quantize_reference for the exact rules)."""
    kwargs = dict(power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose)
    if resolve_backend(x.device, backend) == "triton":
        from .quantize import quantize_triton  # Triton is imported only where it is used

        return quantize_triton(x, fp8_dtype, granularity, **kwargs)
    return quantize_reference(x, fp8_dtype, granularity, **kwargs)


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """C = (A * scale_a) @ (B * scale_b).T [+ bias] [+ C] with fp32 accumulation (see gemm_reference)."""
    kwargs = dict(out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate)
    if resolve_backend(a.device, backend) == "triton":
        from .gemm import fp8_gemm_triton

        return fp8_gemm_triton(a, b, scale_a, scale_b, **kwargs)
    return fp8_gemm_reference(a, b, scale_a, scale_b, **kwargs)
