"""Float8Tensor: the name FP8 code uses for megafp8_kernels.QuantizedTensor (an operand with its format, scale layout,
copies, scales and true byte size; the collectives move its parts as bytes).

A plain container, not a torch.Tensor subclass: it only travels between the quantizers, the GEMMs and the
collectives, never through arbitrary torch ops, so a subclass would add dispatch rules and no value.
"""
from __future__ import annotations

from megafp8_kernels import QuantizedTensor

Float8Tensor = QuantizedTensor  # `Float8Tensor(shape, fp8_dtype, granularity, data, scale_inv, ...)` as always

__all__ = ["Float8Tensor", "QuantizedTensor"]
