"""Torch reference twins of the fused prologue quantizers: RMSNorm -> quantize and SwiGLU -> quantize.

The high-precision math here is THE definition megafp8's RMSNorm and SwiGLU modules run, so the fused op on
its reference path (CPU) produces exactly the bytes of the unfused path: the same aten ops, then
quantize_reference. The Triton twins (norm_quantize_triton.py) compute the same values in one pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantize_reference import quantize_reference
from .scaling import Fp8Quantized, Granularity


def rms_norm_forward_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalized in fp32 and cast back before the scale, as
    transformers' LlamaRMSNorm (the result has the promoted dtype of weight and x); also returns the fp32
    ``rstd = 1 / sqrt(mean(x^2) + eps)`` per row, all the backward needs besides x and weight."""
    x_fp32 = x.float()
    rstd = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x_fp32 * rstd).to(x.dtype), rstd


def rms_norm_backward_reference(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of rms_norm_forward_reference, with n = x * rstd (fp32) and dn = grad * weight:
    dx = rstd * (dn - n * mean(dn * n)), dweight = sum over tokens of grad * n (in fp32, then the weight's dtype)."""
    normed = x.float() * rstd
    # The cast back to x's dtype passes the gradient straight through. grad * weight in fp32, not in a low-precision
    # input dtype as autograd of the forward would: that halves dx's error vs fp64 for bf16/fp16 (tests/
    # test_rms_norm_backward_fp64.py); fp32 inputs give the same bits.
    grad_normed = grad.float() * weight.float()
    grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    grad_weight = (grad.float() * normed.to(x.dtype).float()).reshape(-1, weight.numel()).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_forward_reference(x, weight, eps)[0]


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, channel_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, times Smooth-SwiGLU's per-channel power-of-two scales when given (exact)."""
    h = F.silu(gate) * up
    return h if channel_scale is None else h * channel_scale.to(h.dtype)


def rmsnorm_quantize_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype,
                               granularity_: str | Granularity = Granularity.TENSORWISE, *,
                               power_of_2_scale: bool = False, scale: torch.Tensor | None = None,
                               transpose: bool = False, stats: bool = False) -> tuple[Fp8Quantized, torch.Tensor]:
    """(quantize(rms_norm(x)), rstd) for a 2-D (tokens, hidden) x; the normalized tensor is not returned. stats=True
    adds the cast's saturated/flushed counts (quantize_reference's)."""
    normed, rstd = rms_norm_forward_reference(x, weight, eps)
    return quantize_reference(normed, fp8_dtype, granularity_, power_of_2_scale=power_of_2_scale, scale=scale,
                              transpose=transpose, stats=stats), rstd


def swiglu_quantize_reference(gate_up: torch.Tensor, channel_scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                              granularity_: str | Granularity = Granularity.TENSORWISE, *,
                              power_of_2_scale: bool = False, scale: torch.Tensor | None = None,
                              transpose: bool = False, stats: bool = False) -> Fp8Quantized:
    """quantize(swiglu(gate, up) * s) for a 2-D (tokens, 2 * ffn) gate_up = [gate | up] (stats as rmsnorm's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_reference(swiglu_reference(gate, up, channel_scale), fp8_dtype, granularity_,
                              power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose, stats=stats)
