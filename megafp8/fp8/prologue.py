"""Input prologues of an FP8 linear: the op in front of its GEMM (RMSNorm before QKV / FC1, SwiGLU before FC2),
fused into the quantization of the GEMM's input (TransformerEngine's LayerNormLinear idea).

The FP8 op (linear_function.py) receives the prologue's input instead of the GEMM's and quantizes prologue(x) in
one kernel (megafp8_kernels.rmsnorm_quantize / swiglu_quantize) without writing it in high precision. Backward
runs the same math as the unfused modules, so fused and unfused agree bit for bit: RMSNorm's own backward from
the saved x and rstd (the module RMSNorm is the same autograd function), SwiGLU recomputed with autograd from
FC1's output (two elementwise ops, instead of keeping silu(gate) in high precision).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megafp8_kernels import (
    Fp8Quantized,
    Granularity,
    rms_norm_backward_reference,
    rms_norm_forward_reference,
    rmsnorm_quantize,
    swiglu_quantize,
    swiglu_reference,
)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its backward written out from (x, rstd): one gradient for x (summed with the residual's in any
    order, the same bits), and the backward the fused prologue runs too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = rms_norm_forward_reference(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward_reference(grad, x, weight, rstd)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


@dataclass(frozen=True)
class RMSNormPrologue:
    """``weight * x / sqrt(mean(x^2) + eps)`` (megafp8.model.norm.RMSNorm) in front of a GEMM."""

    weight: torch.Tensor
    eps: float

    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)

    def apply(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The unfused module, differentiable (high-precision layers, torch.compile)."""
        return rms_norm(x, weight, self.eps)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The high-precision output and what backward needs besides (x, weight)."""
        y, rstd = rms_norm_forward_reference(x, weight, self.eps)
        return y, (rstd,)

    def quantize(self, x2d: torch.Tensor, weight: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity, *,
                 power_of_2_scale: bool, scale: torch.Tensor | None, transpose: bool,
                 stats: bool) -> tuple[Fp8Quantized, tuple[torch.Tensor, ...]]:
        q, rstd = rmsnorm_quantize(x2d, weight, self.eps, fp8_dtype, granularity, power_of_2_scale=power_of_2_scale,
                                   scale=scale, transpose=transpose, stats=stats)
        return q, (rstd.view(*x2d.shape[:-1], 1),)

    def output_meta(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.Size]:
        dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
        return dtype, x.shape

    def backward(self, grad: torch.Tensor, needs_grad: tuple[bool, ...], x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> list[torch.Tensor | None]:
        grad_x, grad_weight = rms_norm_backward_reference(grad, x, weight, rstd.view(*x.shape[:-1], 1))
        return [g if need else None for g, need in zip((grad_x, grad_weight), needs_grad)]

    def with_channel_scale(self, channel_scale: torch.Tensor) -> RMSNormPrologue:
        raise ValueError("a per-channel input scale (Smooth-SwiGLU) applies to FC2's SwiGLU input, not to a norm")


@dataclass(frozen=True)
class SwiGLUPrologue:
    """``silu(gate) * up`` of FC1's output ``[gate | up]``, times Smooth-SwiGLU's channel scales when set."""

    channel_scale: torch.Tensor | None = None

    def params(self) -> tuple[torch.Tensor, ...]:
        return ()

    def apply(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return swiglu_reference(gate, up, self.channel_scale)

    def forward(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.apply(gate_up), ()

    def quantize(self, gate_up2d: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity, *,
                 power_of_2_scale: bool, scale: torch.Tensor | None, transpose: bool,
                 stats: bool) -> tuple[Fp8Quantized, tuple[torch.Tensor, ...]]:
        return swiglu_quantize(gate_up2d, self.channel_scale, fp8_dtype, granularity, power_of_2_scale=power_of_2_scale,
                               scale=scale, transpose=transpose, stats=stats), ()

    def output_meta(self, gate_up: torch.Tensor) -> tuple[torch.dtype, torch.Size]:
        return gate_up.dtype, torch.Size((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    def backward(self, grad: torch.Tensor, needs_grad: tuple[bool, ...], gate_up: torch.Tensor) -> list[torch.Tensor | None]:
        # Recomputed with autograd: the unfused path's ops and derivative formulas, so its bits.
        inputs = gate_up.detach().requires_grad_(needs_grad[0])
        if not needs_grad[0]:
            return [None]
        with torch.enable_grad():
            out = self.apply(inputs)
        return list(torch.autograd.grad(out, [inputs], grad))

    def with_channel_scale(self, channel_scale: torch.Tensor) -> SwiGLUPrologue:
        return dataclasses.replace(self, channel_scale=channel_scale)


InputPrologue = RMSNormPrologue | SwiGLUPrologue
