"""megafp8_kernels: FP8 quantization and GEMM kernels (Triton) with their torch reference twins.

Imported as `megafp8_kernels` (the folder is kernels/; a bare `kernels` would shadow a PyPI package).
Knows nothing of models or process groups.
"""
from .dispatch import BACKENDS, fp8_gemm, quantize, resolve_backend
from .gemm_reference import dequantize
from .quantize_reference import expand_scale, scale_from_amax
from .scaling import BLOCK, E4M3, E5M2, Fp8Format, Fp8Quantized, GemmScaleMode, Granularity, fp8_format, scale_shape

__all__ = [
    "BACKENDS", "BLOCK", "E4M3", "E5M2", "Fp8Format", "Fp8Quantized", "GemmScaleMode", "Granularity",
    "dequantize", "expand_scale", "fp8_format", "fp8_gemm", "quantize", "resolve_backend", "scale_from_amax", "scale_shape",
]
