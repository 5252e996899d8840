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
        return torch.full((), self.static_scale, device=device)

    @property
    def needs_global_amax(self) -> bool:
        return False  # one scale everywhere, agreed by construction

    def agreed_scale(self, x2d: torch.Tensor, scale: torch.Tensor | None, comm) -> torch.Tensor:
        return scale if scale is not None else self.fixed_scale(x2d.device)

    def fuses_sequence_shard(self, rows: int, scale: torch.Tensor | None, transpose: bool) -> bool:
        return True  # a given per-tensor scale: the shard's fused cast is the unfused path's bytes
