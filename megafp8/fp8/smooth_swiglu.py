"""SwiGLU and Smooth-SwiGLU (Fishman et al., "Scaling FP8 training to trillion-token LLMs", 2024).

SwiGLU's output h = silu(gate) * up grows outlier channels quadratically late in training, and one such
channel sets the FP8 scale of FC2's whole input, flushing the rest towards zero. Smooth-SwiGLU scales
each channel of h by s_c before the FP8 quantization and folds 1/s_c into FC2's weight columns:
(h * s) @ (W / s)^T == h @ W^T. With s_c a power of two both products are exact in binary floating
point, so in high precision the layer's output is bit-identical to plain SwiGLU.
"""
from __future__ import annotations

import torch

from megafp8_kernels import swiglu_reference


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(gate, up)  # the math the fused SwiGLU -> FP8 cast also runs (megafp8.fp8.prologue)


@torch.no_grad()
def smooth_swiglu_channel_scales(h: torch.Tensor) -> torch.Tensor:
    """Per-channel (last dim) power-of-two scales s_c with max|h_c * s_c| in [0.5, 1); all-zero channels get 1.
    Exponents are clamped to [-64, 64], so a channel of near-zero values (silu far into its negative
    side) gets a finite scale instead of an overflowing one.

    Computed from this micro-batch and not differentiated (a scale choice, not part of the function).
    Channels are local to a tensor-parallel rank (FC1 is column-parallel), so no communication is needed.
    """
    amax = h.detach().reshape(-1, h.shape[-1]).abs().amax(dim=0).float()
    _, exponent = torch.frexp(amax)  # amax = m * 2**e with m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(amax), (-exponent).clamp(-64, 64))
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(amax))
