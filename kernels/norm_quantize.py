"""Fused prologue quantizers as torch custom ops: megafp8::rmsnorm_quantize (the QKV / FC1 input) and
megafp8::swiglu_quantize (the FC2 input). Each reads the prologue's input once and writes only the FP8 bytes
(+ the transposed copy, scales, amax) the GEMM consumes, never the high-precision activation; with stats=True also
the cast's saturated/flushed counts (as megafp8::quantize's), so telemetry and the saturation guard stay fused.

Backends as dispatch.py: the Triton kernels (norm_quantize_triton.py) on CUDA, the reference twins
(norm_quantize_reference.py) on CPU; fake implementations let torch.compile trace through them.
"""
from __future__ import annotations

import torch

from .custom_op_startup import run_eagerly_until_dynamo
from .dispatch import resolve_backend, unaliased_outputs
from .norm_quantize_reference import rmsnorm_quantize_reference, swiglu_quantize_reference
from .scaling import Fp8Quantized, Granularity, check_quantize_args, empty_scales, granularity

# data, scale_inv, amax, data_t, scale_inv_t, counts: megafp8::quantize's outputs, in its order.
_Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _outputs(q: Fp8Quantized, like: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, stats: bool) -> _Outputs:
    # A custom op returns tensors, not None: outputs the call did not ask for are empty.
    counts = q.counts if stats else like.new_empty(0, dtype=torch.int64)
    if transpose:  # a one-row input's transposed copy is a view of its data: unaliased
        return unaliased_outputs((q.data, q.scale_inv, q.amax, q.data_t, q.scale_inv_t, counts))
    return (q.data, q.scale_inv, q.amax, like.new_empty(0, dtype=fp8_dtype), like.new_empty(0, dtype=torch.float32),
            counts)


def _fake_outputs(like: torch.Tensor, rows: int, cols: int, fp8_dtype: torch.dtype, gran_: str,
                  scale: torch.Tensor | None, transpose: bool, stats: bool) -> _Outputs:
    gran = granularity(gran_)
    check_quantize_args(like.new_empty((rows, cols)), fp8_dtype, gran, scale)
    dev = like.device
    data = like.new_empty((rows, cols), dtype=fp8_dtype)
    counts = like.new_empty(2 if stats else 0, dtype=torch.int64)
    if not transpose:
        return (data, empty_scales(rows, cols, gran, dev), empty_scales(rows, cols, gran, dev),
                like.new_empty(0, dtype=fp8_dtype), like.new_empty(0, dtype=torch.float32), counts)
    return (data, empty_scales(rows, cols, gran, dev), empty_scales(rows, cols, gran, dev),
            like.new_empty((cols, rows), dtype=fp8_dtype), empty_scales(cols, rows, gran, dev), counts)


@torch.library.custom_op("megafp8::rmsnorm_quantize", mutates_args=())
def _rmsnorm_quantize_op(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype, granularity_: str,
                         power_of_2_scale: bool, scale: torch.Tensor | None, transpose: bool, backend: str,
                         stats: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor, torch.Tensor]:
    kwargs = dict(power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose, stats=stats)
    if resolve_backend(x.device, backend or None) == "triton":
        from .norm_quantize_triton import rmsnorm_quantize_triton

        q, rstd = rmsnorm_quantize_triton(x, weight, eps, fp8_dtype, granularity_, **kwargs)
    else:
        q, rstd = rmsnorm_quantize_reference(x, weight, eps, fp8_dtype, granularity_, **kwargs)
    return (*_outputs(q, x, fp8_dtype, transpose, stats), rstd)


run_eagerly_until_dynamo(_rmsnorm_quantize_op)


@_rmsnorm_quantize_op.register_fake
def _(x, weight, eps, fp8_dtype, granularity_, power_of_2_scale, scale, transpose, backend, stats=False):
    rstd = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return (*_fake_outputs(x, x.shape[0], x.shape[1], fp8_dtype, granularity_, scale, transpose, stats), rstd)


@torch.library.custom_op("megafp8::swiglu_quantize", mutates_args=())
def _swiglu_quantize_op(gate_up: torch.Tensor, channel_scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                        granularity_: str, power_of_2_scale: bool, scale: torch.Tensor | None, transpose: bool,
                        backend: str, stats: bool = False) -> _Outputs:
    kwargs = dict(power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose, stats=stats)
    if resolve_backend(gate_up.device, backend or None) == "triton":
        from .norm_quantize_triton import swiglu_quantize_triton

        q = swiglu_quantize_triton(gate_up, channel_scale, fp8_dtype, granularity_, **kwargs)
    else:
        q = swiglu_quantize_reference(gate_up, channel_scale, fp8_dtype, granularity_, **kwargs)
    return _outputs(q, gate_up, fp8_dtype, transpose, stats)


run_eagerly_until_dynamo(_swiglu_quantize_op)


@_swiglu_quantize_op.register_fake
def _(gate_up, channel_scale, fp8_dtype, granularity_, power_of_2_scale, scale, transpose, backend, stats=False):
    return _fake_outputs(gate_up, gate_up.shape[0], gate_up.shape[1] // 2, fp8_dtype, granularity_, scale, transpose,
                         stats)


def _result(outputs: _Outputs, transpose: bool, stats: bool) -> Fp8Quantized:
    data, scale_inv, amax, data_t, scale_inv_t, counts = outputs
    return Fp8Quantized(data, scale_inv, amax, data_t if transpose else None, scale_inv_t if transpose else None,
                        counts if stats else None)


def _check_2d(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{what} expects a 2-D (tokens, features) tensor, got shape {tuple(t.shape)}")


def rmsnorm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype,
                     granularity: str | Granularity = Granularity.TENSORWISE, *, power_of_2_scale: bool = False,
                     scale: torch.Tensor | None = None, transpose: bool = False, stats: bool = False,
                     backend: str | None = None) -> tuple[Fp8Quantized, torch.Tensor]:
    """(quantize(rms_norm(x, weight, eps)), rstd) in one op (see quantize for the arguments, stats included, and the
    rounding rules; rstd = 1 / sqrt(mean(x^2) + eps), fp32 (tokens, 1), is what the norm's backward needs)."""
    _check_2d(x, "rmsnorm_quantize")
    gran = granularity.value if isinstance(granularity, Granularity) else granularity
    *outputs, rstd = torch.ops.megafp8.rmsnorm_quantize(x, weight, eps, fp8_dtype, gran, power_of_2_scale, scale,
                                                        transpose, backend or "", stats)
    return _result(tuple(outputs), transpose, stats), rstd


def swiglu_quantize(gate_up: torch.Tensor, channel_scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                    granularity: str | Granularity = Granularity.TENSORWISE, *, power_of_2_scale: bool = False,
                    scale: torch.Tensor | None = None, transpose: bool = False, stats: bool = False,
                    backend: str | None = None) -> Fp8Quantized:
    """quantize(silu(gate) * up * channel_scale) in one op, gate_up = [gate | up] along the last dim."""
    _check_2d(gate_up, "swiglu_quantize")
    if gate_up.shape[1] % 2:
        raise ValueError(f"swiglu_quantize needs [gate | up] halves of equal width, got {gate_up.shape[1]} features")
    gran = granularity.value if isinstance(granularity, Granularity) else granularity
    return _result(torch.ops.megafp8.swiglu_quantize(gate_up, channel_scale, fp8_dtype, gran, power_of_2_scale, scale,
                                                     transpose, backend or "", stats), transpose, stats)
