"""megafp8_kernels: FP8 quantization and GEMM kernels (Triton) with their torch reference twins.

Imported as `megafp8_kernels` (the folder is kernels/). A Python started at the repository root (or a tool that
puts the checkout on sys.path) also finds this folder under the bare name `kernels`, which is PyPI's package
(transformers imports it): imported under that name, this file hands the name over to the installed one.
Knows nothing of models or process groups. formats.py declares what an operand is (ElementFormat, ScaleLayout);
Granularity names today's four layouts, and fp8_gemm runs the scale mode its caller's layouts declare.
A QuantizedTensor is one operand (format, layout, payload, scales, true byte size); scaled_gemm multiplies two of
them by their declared layouts. counter_hash is the stochastic-rounding hash kernels draw from.
Microscaling (MXFP8, MXFP4, NVFP4): microscaling.quantize_microscaled (twin: microscaling_reference.py, Triton:
microscaling_triton.py) and block_scaled_gemm.py (tl.dot_scaled), which scaled_gemm dispatches microscaled pairs to.
quantize and fp8_gemm are torch custom ops (megafp8::*) with fake implementations, so torch.compile traces
through them.
The Triton quantizer lives in quantize_triton.py, not quantize.py: importing a submodule named
`quantize` would replace this package's `quantize` function with the module.
"""

if __name__ == "kernels":
    # Found by the bare folder name, not as megafp8_kernels: import the installed `kernels` with every sys.path entry
    # that leads to this folder (a checkout, or a link to its kernels/) left out. It lands in sys.modules["kernels"],
    # which the import system then returns in place of this module. Without one: the usual ModuleNotFoundError.
    import importlib as _importlib
    import os as _os
    import sys as _sys

    _this_folder = _os.path.dirname(_os.path.realpath(__file__))
    _search_path = _sys.path[:]
    _sys.path[:] = [entry for entry in _search_path
                    if _os.path.realpath(_os.path.join(entry or _os.curdir, "kernels")) != _this_folder]
    del _sys.modules["kernels"]
    try:
        _importlib.import_module("kernels")
    finally:
        _sys.path[:] = _search_path
else:
    from .dispatch import BACKENDS, GEMM_BACKENDS, fp8_gemm, quantize, resolve_backend, resolve_gemm_backend
    from .formats import ElementFormat, ScaleFormat, ScaleLayout, element_format, scale_layout
    from .gemm_reference import dequantize
    from .norm_quantize import rmsnorm_quantize, swiglu_quantize
    from .norm_quantize_reference import (
        rms_norm_backward_reference,
        rms_norm_forward_reference,
        rms_norm_reference,
        swiglu_reference,
    )
    from .quantize_reference import expand_scale, scale_from_amax
    from .quantized_tensor import QuantizedTensor, wire_bytes
    from .scaled_gemm import has_kernel, scaled_gemm, scaled_gemm_reference
    from .scaled_mm import DEFAULT_SCALED_MM_MODES, SCALED_MM_ENV_VAR, scaled_mm_modes
    from .scaling import BLOCK, E4M3, E5M2, Fp8Format, Fp8Quantized, GemmScaleMode, Granularity, empty_scales, fp8_format, scale_shape

    __all__ = [
        "BACKENDS", "BLOCK", "DEFAULT_SCALED_MM_MODES", "E4M3", "E5M2", "ElementFormat", "Fp8Format", "Fp8Quantized",
        "GEMM_BACKENDS", "GemmScaleMode", "Granularity", "QuantizedTensor", "SCALED_MM_ENV_VAR", "ScaleFormat", "ScaleLayout",
        "dequantize", "has_kernel",
        "element_format", "empty_scales", "expand_scale", "fp8_format", "fp8_gemm", "quantize", "resolve_backend",
        "resolve_gemm_backend", "rms_norm_backward_reference", "rms_norm_forward_reference", "rms_norm_reference",
        "rmsnorm_quantize", "scale_from_amax", "scale_layout", "scale_shape", "scaled_gemm", "scaled_gemm_reference",
        "scaled_mm_modes", "swiglu_quantize", "swiglu_reference", "wire_bytes",
    ]
