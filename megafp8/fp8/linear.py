"""FP8-capable linear modules: the shared base (recipe, delayed-scaling state, per-step FP8 weight cache,
telemetry) and the plain Fp8Linear. Tensor-parallel layers in megafp8.parallel derive from the same base.

The autograd op itself (the three FP8 GEMMs) is in linear_function.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .autocast import resolve_recipe
from .linear_function import SequenceParallelComm, fp8_linear, quantize_operand
from .recipe import ROLES, Fp8Recipe
from .scaling_state import ScalingState
from .tensor import Float8Tensor

HighPrecisionLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class Fp8GemmModule(nn.Module):
    """Base of every layer whose GEMM may run in FP8.

    recipe:               this layer's own recipe (per-layer override); None = follow fp8_autocast
    force_high_precision: run in high precision whatever the recipe (precision map, output head: config)
    guard_high_precision: switched to high precision by the SaturationGuard (checkpointed by the guard)
    telemetry_enabled:    record FP8 statistics of each quantization (see telemetry.py)
    """

    def __init__(self, recipe: Fp8Recipe | None = None):
        super().__init__()
        self.recipe = recipe
        self.force_high_precision = False
        self.guard_high_precision = False
        self.telemetry_enabled = False
        self.fp8_telemetry: dict[str, dict[str, torch.Tensor]] = {}
        self.fp8_scaling = nn.ModuleDict()
        self._weight_cache: tuple[tuple, Float8Tensor] | None = None

    @property
    def runs_high_precision(self) -> bool:
        return self.force_high_precision or self.guard_high_precision

    # ---- recipe and delayed-scaling state ----
    def set_recipe(self, recipe: Fp8Recipe | None) -> None:
        if recipe != self.recipe:
            self.recipe = recipe
            self.invalidate_weight_cache()
        if recipe is not None and recipe.is_delayed and (
                "input" not in self.fp8_scaling or self.fp8_scaling["input"].recipe != recipe):
            self._make_scaling_states(recipe)

    def _make_scaling_states(self, recipe: Fp8Recipe) -> None:
        device = next((p.device for p in self.parameters(recurse=False)), None)
        for role in ROLES:
            self.fp8_scaling[role] = ScalingState(recipe, recipe.dtype(role)).to(device)

    def scaling_state(self, role: str, recipe: Fp8Recipe) -> ScalingState | None:
        if not recipe.is_delayed:
            return None
        if role not in self.fp8_scaling or self.fp8_scaling[role].recipe != recipe:
            self._make_scaling_states(recipe)  # recipe came from fp8_autocast: allocate on first use
        return self.fp8_scaling[role]

    # ---- the FP8 weight, once per optimizer step ----
    def fp8_weight(self, recipe: Fp8Recipe, weight: torch.Tensor, cacheable: bool = True) -> Float8Tensor:
        """The weight in FP8, quantized once per optimizer step and reused by every micro-batch.

        The cache is keyed on the tensor's version counter (bumped by in-place optimizer updates) and is
        dropped by invalidate_fp8_weight_caches (Fp8ScalingManager.update calls it every step; a loop that
        writes weights through `.data`, which bumps no version, must call it after each step).
        A derived weight (Smooth-SwiGLU's rescaled one) is not cacheable: it changes every micro-batch.
        Under a delayed recipe it still uses the weight role's delayed scale, synchronized over TP x DP
        like every delayed scale (so sharded runs quantize exactly as TP=1); a new outlier channel can
        then clip weight columns until the amax history catches up, which telemetry reports."""
        transpose = torch.is_grad_enabled()  # dgrad needs W^T; inference does not
        if not cacheable:
            return self._quantize_weight(weight, recipe, transpose)
        key = (weight._version, weight.data_ptr(), recipe, transpose)
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = (key, self._quantize_weight(weight, recipe, transpose))
        return self._weight_cache[1]

    def _quantize_weight(self, weight: torch.Tensor, recipe: Fp8Recipe, transpose: bool) -> Float8Tensor:
        with torch.no_grad():
            return quantize_operand(weight.detach(), recipe, "weight", self.scaling_state("weight", recipe), transpose, self)

    def invalidate_weight_cache(self) -> None:
        self._weight_cache = None

    # ---- the GEMM ----
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               input_channel_scale: torch.Tensor | None = None, sp_input: SequenceParallelComm | None = None,
               sp_output: SequenceParallelComm | None = None,
               high_precision: HighPrecisionLinear = F.linear) -> torch.Tensor:
        """x W^T (+ b) in FP8 when a recipe is active, else `high_precision(x, W, b)`.

        input_channel_scale: Smooth-SwiGLU — quantize x*s and fold 1/s into W's columns, so the product
                             is unchanged while x's outlier channels no longer set its FP8 scale.
        sp_input / sp_output: sequence-parallel communication done inside the FP8 op (see fp8_linear);
                             the high-precision callable must then do the same communication itself.
        """
        if input_channel_scale is not None:
            s = input_channel_scale.to(x.dtype)
            x, weight = x * s, weight / s  # exact when s is a power of two (smooth_swiglu_channel_scales)
        recipe = resolve_recipe(self.recipe, self.runs_high_precision)
        if recipe is None:
            return high_precision(x, weight, bias)
        if not torch.is_grad_enabled():  # inference: nothing to save for backward, no transposed copies
            x, weight = x.detach(), weight.detach()
            bias = bias.detach() if bias is not None else None
        weight_fp8 = self.fp8_weight(recipe, weight, cacheable=input_channel_scale is None)
        return fp8_linear(x, weight, bias, weight_fp8, recipe, self, sp_input, sp_output)


class Fp8Linear(Fp8GemmModule):
    """y = x W^T + b with the three GEMMs in FP8 when a recipe is active, else in the input's precision.

    forward(x, input_channel_scale=s) is the Smooth-SwiGLU entry (see Fp8GemmModule.linear).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Fp8Recipe | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.set_recipe(recipe)

    def forward(self, x: torch.Tensor, input_channel_scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias, input_channel_scale=input_channel_scale)

    def extra_repr(self) -> str:
        recipe = "autocast" if self.recipe is None else self.recipe.scaling
        hp = ", high precision" if self.runs_high_precision else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, recipe={recipe}{hp}"


def invalidate_fp8_weight_caches(model: nn.Module) -> None:
    """Drop every cached FP8 weight (after an optimizer step that wrote weights without bumping versions)."""
    for module in model.modules():
        if isinstance(module, Fp8GemmModule):
            module.invalidate_weight_cache()
