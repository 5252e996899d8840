"""The FP4 wgrad's quantization noise against the gradient itself: "FP4 All the Way"'s signal for the late switch.

Chmiel et al. find FP4 training stops paying once the gradient norm falls below about sqrt(3) times the quantization
noise (sqrt(3) sigma is half the width of a uniform noise's range: below it the quantized gradient is mostly noise).
A layer given a ``GradNoiseProbe`` (the trainer does so on probe iterations only, FP4 layers only) measures both on
its own weight gradient, per micro-batch, beside the real GEMMs and without touching them:

    exact  = dY^T @ x                     (fp32, from the high-precision dY and the input saved for this step)
    noise  = wgrad(Q(dY)^T, Q(x^T)) - exact   (the FP4 GEMM on the very operands the step used: SR, RHT, 2-D tiles)

and sums each over the step's micro-batches. The trainer then reduces them like gradients and compares the norms
(megafp8.training.grad_noise_trigger). The extra cost, on probe iterations only: the layer's high-precision input kept
to backward, two GEMMs and two weight-sized fp32 buffers per FP4 layer.
"""
from __future__ import annotations

import torch
from torch import nn


class GradNoiseProbe:
    """One layer's sums over a step's micro-batches: the exact weight gradient and the FP4 GEMM's error on it."""

    def __init__(self) -> None:
        self.exact: torch.Tensor | None = None
        self.noise: torch.Tensor | None = None

    def record(self, dy2d: torch.Tensor, x2d: torch.Tensor, quantized: torch.Tensor,
               column_scale: torch.Tensor | None) -> None:
        """Add one micro-batch: `quantized` is the FP4 wgrad GEMM's fp32 result (before any column scale)."""
        exact = dy2d.float().t() @ x2d.float()
        noise = quantized - exact
        if column_scale is not None:  # Smooth-SwiGLU: both are gradients of W / s, scaled to the leaf's
            exact, noise = exact * column_scale, noise * column_scale
        if self.exact is None:
            self.exact, self.noise = exact, noise
        else:
            self.exact += exact
            self.noise += noise


def enable_grad_noise_probes(model: nn.Module, enabled: bool) -> None:
    """Give every FP8/FP4 layer a fresh probe (or take them away); the op records into it when the layer's GEMMs run
    an FP4 recipe (the precision plan's current choice), and leaves it empty otherwise."""
    for module in model.modules():
        if hasattr(module, "fp8_telemetry"):
            module.grad_noise_probe = GradNoiseProbe() if enabled else None


def grad_noise_probes(model: nn.Module) -> list[GradNoiseProbe]:
    """The probes that recorded this step, in module order (the same on every replica of a stage)."""
    return [m.grad_noise_probe for m in model.modules()
            if getattr(m, "grad_noise_probe", None) is not None and m.grad_noise_probe.exact is not None]
