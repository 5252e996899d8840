"""Test hook that makes one FP8 layer's input overflow, to show the saturation guard at work.

    MEGAFP8_FORCE_FP8_OVERFLOW=LAYER@ITERATION[xFACTOR]     e.g. layers.1.mlp.linear_fc2@100x256

From training iteration ITERATION on, LAYER (a global module name, as in the FP8 telemetry tags) quantizes
its input with its FP8 scale multiplied by FACTOR (default 4096): every input value above amax / FACTOR
is clipped to FP8_MAX, exactly what a stale delayed scale does to an activation burst, while the
high-precision values, the amax history and every other layer stay untouched. Once the guard moves the layer
to high precision its quantizer no longer runs, so the clipping stops and training recovers. Unset in
real runs. Per-tensor-scaled inputs only (the delayed and tensorwise recipes).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from megafp8_kernels import Granularity, fp8_format, scale_from_amax

ENV = "MEGAFP8_FORCE_FP8_OVERFLOW"
DEFAULT_FACTOR = 4096.0
_SPEC = re.compile(r"^(?P<layer>[\w.]+)@(?P<iteration>\d+)(x(?P<factor>\d+(\.\d*)?))?$")


@dataclass(frozen=True)
class ForcedOverflow:
    layer: str
    from_iteration: int
    factor: float = DEFAULT_FACTOR
    ENV: ClassVar[str] = ENV

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ForcedOverflow | None:
        spec = environ.get(ENV, "").strip()
        if not spec:
            return None
        match = _SPEC.match(spec)
        if match is None or (match["factor"] is not None and float(match["factor"]) <= 1):
            raise ValueError(f"{ENV}={spec!r}: expected LAYER@ITERATION[xFACTOR] with FACTOR > 1, "
                             "e.g. layers.1.mlp.linear_fc2@100x16")
        factor = float(match["factor"]) if match["factor"] else DEFAULT_FACTOR
        return cls(match["layer"], int(match["iteration"]), factor)

    def describe(self) -> str:
        return f"{self.layer}'s FP8 input scale x{self.factor:g} from iteration {self.from_iteration}"

    def target(self, model: nn.Module) -> nn.Module | None:
        """The FP8 layer on this rank's model chunks, or None when another pipeline stage holds it."""
        module = dict(model.named_modules()).get(self.layer)
        if module is not None and not hasattr(module, "forced_overflow_factor"):
            raise ValueError(f"{ENV}: {self.layer!r} is not an FP8 linear layer")
        return module

    def arm(self, layer: nn.Module, iteration: int) -> None:
        """Arm `layer` (this hook's target) from `from_iteration` on (call before each training iteration)."""
        layer.forced_overflow_factor = self.factor if iteration >= self.from_iteration else None


def check_forced_overflow(fp8_format: str | None, fp8_recipe: str) -> ForcedOverflow | None:
    """The hook's spec from the environment, checked against the run's FP8 flags (before any process group)."""
    hook = ForcedOverflow.from_env()
    if hook is not None and (fp8_format is None or fp8_recipe not in ("delayed", "tensorwise")):
        raise ValueError(f"{ENV} forces an FP8 input to overflow: it needs --fp8-format and --fp8-recipe "
                         f"delayed or tensorwise (per-tensor input scales), got {fp8_format} / {fp8_recipe}")
    return hook


def overflowing_scale(x2d: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                      granularity: Granularity, power_of_2_scale: bool, factor: float) -> torch.Tensor:
    """The layer's input scale (delayed, or the current one from x's amax) times `factor`."""
    if granularity is not Granularity.TENSORWISE:
        raise ValueError(f"{ENV} forces overflow of per-tensor-scaled inputs only (recipes delayed, tensorwise); "
                         f"this layer's input is scaled {granularity.value}")
    if scale is None:
        scale = scale_from_amax(x2d.detach().abs().amax().float(), fp8_format(fp8_dtype).max, power_of_2_scale)
    return scale * factor
