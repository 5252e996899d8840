"""Test hook that grows an outlier feature in one FP8 layer's input, to compare the kurtosis warning with the guard.

    MEGAFP8_FORCE_OUTLIER=LAYER@ITERATION[xGROWTH]     e.g. layers.1.mlp.linear_fc2@50x1.25

From training iteration ITERATION on, LAYER (a global module name, as in the FP8 telemetry tags) multiplies the
first 1/32 of its input's channels by GROWTH^(iterations since ITERATION + 1) (default 1.25) before anything else
sees the input: the high-precision values change, as when outlier features emerge in a real run (FOG's divergence
mechanism), so the input's kurtosis rises, the delayed scale lags behind the growing amax, and the casts
saturate once the growth per step outruns it. For a layer with a fused prologue the hook scales the prologue's input
(the norm's or SwiGLU's), so the outliers reach the FP8 cast through it. Unset in real runs.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

ENV = "MEGAFP8_FORCE_OUTLIER"
DEFAULT_GROWTH = 1.25
CHANNEL_FRACTION = 32  # the first ceil(channels / 32) input channels grow
_SPEC = re.compile(r"^(?P<layer>[\w.]+)@(?P<iteration>\d+)(x(?P<growth>\d+(\.\d*)?))?$")


@dataclass
class ForcedOutlier:
    layer: str
    from_iteration: int
    growth: float = DEFAULT_GROWTH
    factor: float = 1.0  # this iteration's multiplier (arm sets it)
    ENV: ClassVar[str] = ENV

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ForcedOutlier | None:
        spec = environ.get(ENV, "").strip()
        if not spec:
            return None
        match = _SPEC.match(spec)
        if match is None or (match["growth"] is not None and float(match["growth"]) <= 1):
            raise ValueError(f"{ENV}={spec!r}: expected LAYER@ITERATION[xGROWTH] with GROWTH > 1, "
                             "e.g. layers.1.mlp.linear_fc2@50x1.25")
        return cls(match["layer"], int(match["iteration"]), float(match["growth"] or DEFAULT_GROWTH))

    def describe(self) -> str:
        return (f"{self.layer}'s first 1/{CHANNEL_FRACTION} input channels x{self.growth:g} per iteration from "
                f"iteration {self.from_iteration}")

    def target(self, model: nn.Module) -> nn.Module | None:
        """The FP8 layer on this rank's model chunks (now carrying the hook), or None when another stage holds it."""
        module = dict(model.named_modules()).get(self.layer)
        if module is None:
            return None
        if not hasattr(module, "fp8_telemetry"):
            raise ValueError(f"{ENV}: {self.layer!r} is not an FP8 linear layer")
        module.register_forward_pre_hook(self._grow_outliers)
        return module

    def arm(self, layer: nn.Module, iteration: int) -> None:
        """This iteration's multiplier (call before each training iteration)."""
        steps = iteration - self.from_iteration + 1
        self.factor = self.growth ** steps if steps > 0 else 1.0

    def _grow_outliers(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.factor == 1.0 or not args:
            return None
        x = args[0]
        channels = math.ceil(x.shape[-1] / CHANNEL_FRACTION)
        scale = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        scale[:channels] = self.factor
        return (x * scale, *args[1:])
