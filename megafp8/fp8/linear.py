"""FP8-capable linear modules: the shared base (recipe, delayed-scaling state, the per-step FP8 weight:
cached or injected by the optimizer, telemetry) and the plain Fp8Linear. Tensor-parallel layers in
megafp8.parallel derive from the same base.

The autograd op itself (the three FP8 GEMMs) is in linear_function.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megafp8_kernels import Granularity

from .autocast import resolve_recipe
from .linear_function import SequenceParallelComm, fp8_linear, known_scale, quantize_operand
from .prologue import InputPrologue
from .recipe import ROLES, Fp8Recipe
from .rounding_keys import RoundingKeys
from .scaling_state import ScalingState
from .tensor import Float8Tensor

HighPrecisionLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class Fp8GemmModule(nn.Module):
    """Base of every layer whose GEMM may run in FP8.

    recipe:               this layer's own recipe (per-layer override); None = follow fp8_autocast
    force_high_precision: run in high precision whatever the recipe (precision map, output head: config)
    guard_high_precision: switched to high precision by the SaturationGuard (checkpointed by the guard)
    telemetry_enabled:    record FP8 statistics of each quantization (see telemetry.py)
    kurtosis_enabled:     record the raw moments of the input (kurtosis.py)
    grad_noise_probe:     an FP4 wgrad's quantization noise against its exact value, on probe steps (grad_noise.py)
    forced_overflow_factor: a test hook's input-scale multiplier (forced_overflow.py); None in real runs
    """

    def __init__(self, recipe: Fp8Recipe | None = None):
        super().__init__()
        self.recipe = recipe
        self.force_high_precision = False
        self.guard_high_precision = False
        self.telemetry_enabled = False
        self.kurtosis_enabled = False  # keep the input's moments (kurtosis.py), on telemetry log iterations
        self.input_moments: torch.Tensor | None = None
        self.grad_noise_probe = None  # a GradNoiseProbe on --fp4-until-grad-noise's probe iterations
        self.forced_overflow_factor: float | None = None
        self.wgrad_deferral = None  # a zero-bubble pipeline chunk's WgradDeferral (deferred_wgrad.py)
        self.smooths_input = False  # Smooth-SwiGLU's FC2: quantizes W / s, s per input (set by the MLP)
        self.fp8_telemetry: dict[str, dict[str, torch.Tensor]] = {}
        self.fp8_scaling = nn.ModuleDict()
        self._weight_cache: tuple[tuple, Float8Tensor, bool] | None = None  # (key, weight, observed)
        self._injected_weight: Float8Tensor | None = None
        self._injected_scale_version: tuple | None = None  # the weight scale's version at injection
        self.rounding_keys = RoundingKeys()  # stochastic rounding's keys; the trainer renews them per iteration

    @property
    def runs_high_precision(self) -> bool:
        return self.force_high_precision or self.guard_high_precision

    @property
    def active_recipe(self) -> Fp8Recipe | None:
        """The recipe this layer's GEMMs run now: its own or fp8_autocast's, None in high precision."""
        return resolve_recipe(self.recipe, self.runs_high_precision)

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
        if not recipe.keeps_state(role):
            return None
        if role not in self.fp8_scaling or self.fp8_scaling[role].recipe != recipe:
            self._make_scaling_states(recipe)  # recipe came from fp8_autocast: allocate on first use
        return self.fp8_scaling[role]

    def next_rounding_key(self, role: str) -> int:
        """The key of this layer's next stochastically rounded cast of `role` (rounding_keys.py)."""
        return self.rounding_keys.next(role)

    def sharded_amax_sync(self) -> Callable[[torch.Tensor], None] | None:
        """An in-place MAX of an amax over the ranks that hold the other shards of this layer's tensors (a TP
        layer: its TP group), or None when this layer's tensors are whole. A cold delayed state quantizes with
        current scaling, and the current scale of a weight, row-parallel input or column-parallel output
        gradient must be the whole tensor's, as in the TP=1 run (see quantize_operand)."""
        return None

    # ---- the FP8 weight, once per optimizer step ----
    def fp8_weight(self, recipe: Fp8Recipe, weight: torch.Tensor, observe: bool = True) -> Float8Tensor:
        """The weight in FP8 for this step: the injected one (set_fp8_weight), else quantized from the
        high-precision weight once and cached until invalidate_weight_cache().

        Invalidation is explicit and owned by the optimizer step (it calls invalidate_fp8_weight_caches
        after writing the weights); the cache key also follows the Parameter's version counter and storage
        as a safety net for plain torch optimizers, but cannot see writes into a flat buffer that the
        Parameter's `.data` merely views. Under a delayed recipe the weight role's delayed scale is used
        (synchronized over TP x DP like every delayed scale, so sharded runs quantize exactly as TP=1), and
        the key holds that scale's version (ScalingState.scale_version, host-side): after an update() the
        first forward re-quantizes under the new scale even if the weight did not change (a skipped step),
        as a module freshly loaded from the state dict does."""
        transpose = torch.is_grad_enabled()  # dgrad needs W^T; inference does not
        if torch.compiler.is_compiling():
            return self._compiled_fp8_weight(recipe, weight, transpose, observe)
        if self._injected_weight is not None:
            return self._injected_fp8_weight(recipe, transpose)
        state = self.scaling_state("weight", recipe)
        key = (recipe, weight.data_ptr(), weight._version, state.scale_version if state is not None else None)
        cached = self._weight_cache
        # An entry built by an evaluation forward did not feed the weight's amax history: a training forward
        # re-quantizes it (and observes), so evaluating between steps leaves the scaling state unchanged.
        if (cached is None or cached[0] != key or (transpose and cached[1].data_t is None)
                or (observe and not cached[2])):
            fp8 = self._quantize_weight(weight.detach(), recipe, transpose, observe)
            cached = self._weight_cache = (key, fp8, observe or not recipe.is_delayed)
        return cached[1]

    def prepare_fp8_weight(self) -> None:
        """Quantize (or check the injected) FP8 weight for the next forward now, eagerly, as that forward would:
        megafp8.model.compile calls it before a compiled layer runs, so that the compiled graph reads the cached
        weight (dynamo cannot trace the cache's data_ptr/_version/scale_version key) instead of quantizing it in
        every micro-batch. A no-op in high precision and under Smooth-SwiGLU (whose W / s changes per input)."""
        recipe = self.active_recipe
        weight = getattr(self, "weight", None)
        if recipe is not None and isinstance(weight, torch.Tensor) and not self.smooths_input:
            self.fp8_weight(recipe, weight, observe=torch.is_grad_enabled() and self.training)

    def _compiled_fp8_weight(self, recipe: Fp8Recipe, weight: torch.Tensor, transpose: bool,
                             observe: bool) -> Float8Tensor:
        """Inside a torch.compile graph: the weight prepare_fp8_weight() left (injected or cached), read without
        the host-side checks; with none there (a plain torch.compile of the model), quantized in the graph."""
        ready = self._injected_weight if self._injected_weight is not None else (
            self._weight_cache[1] if self._weight_cache is not None and (self._weight_cache[2] or not observe)
            else None)
        if ready is not None and (ready.data_t is not None or not transpose):
            return ready
        return self._quantize_weight(weight.detach(), recipe, transpose, observe)

    def _quantize_weight(self, weight: torch.Tensor, recipe: Fp8Recipe, transpose: bool, observe: bool) -> Float8Tensor:
        with torch.no_grad():
            return quantize_operand(weight, recipe, "weight", self.scaling_state("weight", recipe), transpose, self,
                                    observe=observe)

    def set_fp8_weight(self, weight: Float8Tensor) -> None:
        """Hand the layer its FP8 weight for this step (the ZeRO optimizer quantizes its master shard and
        all-gathers the FP8 bytes). Row-major `data` + `scale_inv` are required, quantized as
        fp8_weight_quantization() says; a missing transposed copy is derived (Float8Tensor.with_transpose).
        Until invalidate_weight_cache(), the layer never reads its high-precision weight's values: the
        Parameter only stays the autograd leaf whose gradient goes to `main_grad`."""
        if weight.data is None or weight.scale_inv is None:
            raise ValueError("set_fp8_weight needs the row-major FP8 data and scale_inv")
        own = getattr(self, "weight", None)
        if isinstance(own, torch.Tensor) and tuple(own.shape) != tuple(weight.shape):
            raise ValueError(f"set_fp8_weight: FP8 weight of shape {tuple(weight.shape)} for a layer whose weight is "
                             f"{tuple(own.shape)}")
        self._injected_weight = weight
        self._injected_scale_version = self._weight_scale_version()
        self._weight_cache = None

    def _weight_scale_version(self) -> tuple | None:
        state = self.fp8_scaling["weight"] if "weight" in self.fp8_scaling else None
        return state.scale_version if state is not None else None

    @property
    def injected_weight_outdated(self) -> bool:
        """True when the injected FP8 weight may have been quantized under a delayed weight scale that changed
        since (an update() or a load after the publish): the injector must hand the layer a new one."""
        return self._injected_weight is not None and self._injected_scale_version != self._weight_scale_version()

    def _injected_fp8_weight(self, recipe: Fp8Recipe, transpose: bool) -> Float8Tensor:
        weight, quantizer = self._injected_weight, recipe.quantizer("weight")
        if (weight.format, weight.layout) != (quantizer.format, quantizer.layout):
            raise ValueError(f"injected FP8 weight is {weight.fp8_dtype} {weight.layout.name}, but the recipe "
                             f"{recipe.scaling!r} quantizes weights as {quantizer.format.dtype} {quantizer.layout.name}")
        self._check_injected_weight_current(recipe)
        if transpose and weight.data_t is None:
            weight = self._injected_weight = weight.with_transpose(recipe.power_of_2_scale)  # once per step
        return weight

    def fp8_weight_quantization(self, recipe: Fp8Recipe | None = None) -> WeightQuantization | None:
        """How this layer's weight must be quantized for set_fp8_weight; None when it runs in high precision
        (then the optimizer must keep its high-precision weight). `recipe` defaults to the layer's own."""
        recipe = resolve_recipe(recipe or self.recipe, self.runs_high_precision)
        if recipe is None:
            return None
        state = self.scaling_state("weight", recipe)
        weight = getattr(self, "weight", None)
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        return WeightQuantization(recipe.dtype("weight"), recipe.granularity("weight"), recipe.power_of_2_scale,
                                  known_scale(recipe.quantizer("weight"), state, device), state)

    def drop_quantized_weight_cache(self) -> None:
        """Forget the weight this layer quantized itself (the next forward quantizes and observes again), keeping a
        weight the optimizer injected: a step re-run after its scaling state was restored (StepState)."""
        self._weight_cache = None

    def invalidate_weight_cache(self) -> None:
        """Drop the cached and the injected FP8 weight: the next forward quantizes (or is handed) a new one."""
        self._weight_cache = None
        self._injected_weight = None

    def _check_injected_weight_current(self, recipe: Fp8Recipe) -> None:
        # The layer holds no high-precision weight to re-quantize from, and a module loaded from the state dict
        # would be handed one quantized under the new scale: using the old one silently forks the run.
        if recipe.is_delayed and self._injected_scale_version != self._weight_scale_version():
            raise RuntimeError(
                "the FP8 weight handed to this layer (set_fp8_weight) was quantized under a delayed weight scale "
                "that Fp8ScalingManager.update() or a checkpoint load has changed since: re-publish the FP8 "
                "weights after every update() (DistributedOptimizer does, on a skipped step too)")

    # ---- the GEMM ----
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               input_channel_scale: torch.Tensor | None = None, sp_input: SequenceParallelComm | None = None,
               sp_output: SequenceParallelComm | None = None, tp_input: SequenceParallelComm | None = None,
               high_precision: HighPrecisionLinear = F.linear, prologue: InputPrologue | None = None) -> torch.Tensor:
        """x W^T (+ b) in FP8 when a recipe is active, else `high_precision(x, W, b)`.

        prologue:            x is the input of an RMSNorm / SwiGLU in front of the GEMM (prologue.py); in FP8 it is
                             fused into x's quantization, otherwise (and under torch.compile, whose inductor fuses
                             it itself) it runs first as plain torch ops.

        input_channel_scale: Smooth-SwiGLU — quantize x*s and W/s, so the product is unchanged while x's
                             outlier channels no longer set its FP8 scale; W's gradient still goes to W.
        sp_input / sp_output / tp_input: tensor-parallel communication done inside the FP8 op (see
                             fp8_linear); the high-precision callable must then do the same itself.
        """
        recipe = self.active_recipe
        if prologue is not None and (recipe is None or torch.compiler.is_compiling()):
            x, prologue = prologue.apply(x, *prologue.params()), None
        if recipe is None:
            if input_channel_scale is not None:
                s = input_channel_scale.to(x.dtype)
                x, weight = x * s, weight / s  # exact when s is a power of two (smooth_swiglu_channel_scales)
            return high_precision(x, weight, bias)
        grad = torch.is_grad_enabled()
        observe = grad and self.training  # evaluation must not move the delayed-scaling histories
        if not grad:  # inference: nothing to save for backward, no transposed copies
            x, weight = x.detach(), weight.detach()
            bias = bias.detach() if bias is not None else None
        column_scale = None
        if input_channel_scale is not None:
            s = input_channel_scale.float()
            if prologue is None:
                x = x * s.to(x.dtype)
            else:
                prologue = prologue.with_channel_scale(s)  # scaled inside the fused cast
            weight_fp8 = self._smoothed_fp8_weight(recipe, weight, s, observe)
            column_scale = torch.ones_like(s) / s  # exact: s is a power of two
        else:
            weight_fp8 = self.fp8_weight(recipe, weight, observe)
        return fp8_linear(x, weight, bias, weight_fp8, recipe, self, sp_input, sp_output, tp_input=tp_input,
                          observe=observe, wgrad_column_scale=column_scale, prologue=prologue)

    def _smoothed_fp8_weight(self, recipe: Fp8Recipe, weight: torch.Tensor, s: torch.Tensor,
                             observe: bool) -> Float8Tensor:
        """FP8 of W / s, every micro-batch (s changes with the input). From the injected FP8 weight when there
        is one (dequantized, so a second rounding), else from the high-precision weight."""
        transpose = torch.is_grad_enabled()
        with torch.no_grad():
            if self._injected_weight is not None:
                self._check_injected_weight_current(recipe)
            base = self._injected_weight.dequantize() if self._injected_weight is not None else weight.detach()
            return self._quantize_weight(base / s.to(base.dtype), recipe, transpose, observe)


@dataclass(frozen=True)
class WeightQuantization:
    """What an optimizer needs to produce a layer's FP8 weight (Fp8GemmModule.fp8_weight_quantization).

    scale: the delayed scale to quantize with (all ranks hold the same), or None for current scaling
           (amax of the WHOLE weight shard of this TP rank for tensorwise, per row / 128x128 tile otherwise;
           a cold delayed state also MAX-reduces it with the layer's sharded_amax_sync(), as the layer does).
    state: the delayed-scaling state; call observe(amax of the whole weight) once per step so the
           weight's history keeps moving while the optimizer, not the layer, quantizes it.
    """

    fp8_dtype: torch.dtype
    granularity: Granularity
    power_of_2_scale: bool
    scale: torch.Tensor | None
    state: ScalingState | None

    def observe(self, amax: torch.Tensor) -> None:
        if self.state is not None:
            self.state.observe(amax)


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
    """Drop every cached and injected FP8 weight. The optimizer step calls it after writing the weights (a
    loop with a plain torch optimizer calls it after optimizer.step())."""
    for module in model.modules():
        if isinstance(module, Fp8GemmModule):
            module.invalidate_weight_cache()
