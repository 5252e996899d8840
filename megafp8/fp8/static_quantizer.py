"""StaticQuantizer: μnit Scaling's static FP8 casts (`--fp8-recipe static`): one fixed power-of-two scale per role,
known before the tensor exists, so no amax is reduced to scale anything, nothing is agreed across ranks and nothing is
kept as state (the cast's kernel still reports the tensor's amax as a by-product: telemetry reads it, scaling never
does)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantizer import Quantizer


@dataclass(frozen=True)
class StaticQuantizer(Quantizer):
    """A per-tensor cast with the fixed scale `static_scale` (a power of two: exact to invert). The values must already
    be near unit scale (a unit-scaled model, --unit-scaling): FP8_MAX / static_scale is where they saturate."""

    static_scale: float = 1.0

    def fixed_scale(self, device: torch.device) -> torch.Tensor:
        # Every caller asks for the known scale first (linear_function.known_scale): given, it needs no agreement
        # across ranks, and a sequence shard's fused cast is the unfused path's bytes.
        return torch.full((), self.static_scale, device=device)
