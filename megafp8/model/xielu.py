"""xIELU, the non-gated MLP activation FOG trains with (Huang & Schlag, "Deriving Activation Functions Using
Integration", arXiv 2411.13010; Apertus uses it too). With trainable scalars α_p = softplus(a_p) and
α_n = β + softplus(a_n) (both start at 0.8), β = 0.5 and ε = -1e-6:

    xIELU(x) = α_p x² + β x                                   for x > 0
             = α_n (exp(min(x, ε)) - 1) - α_n x + β x         for x <= 0

the formula of transformers' XIELUActivation (its Python path), which tests/test_xielu.py uses as the peer. Under
tensor parallelism each rank applies it to its own FFN channels, so the scalars' gradients are summed over TP (tagged
like the sequence-parallel norm gains)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.full((1,), _inverse_softplus(alpha_p_init), dtype=params_dtype))
        self.alpha_n = nn.Parameter(torch.full((1,), _inverse_softplus(alpha_n_init - beta), dtype=params_dtype))
        for param in (self.alpha_p, self.alpha_n):
            param.sequence_parallel = True  # replicated over TP, applied to each rank's channels: grads TP-summed
        self.beta, self.eps = beta, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.clamp(x, max=self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x

    def extra_repr(self) -> str:
        return f"beta={self.beta}, eps={self.eps}"
