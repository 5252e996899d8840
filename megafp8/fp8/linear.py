"""FP8 linear layer: fprop, dgrad and wgrad GEMMs all in FP8, with FP8 copies saved for backward.

Shapes (T tokens = all leading dims flattened, in = K of fprop, out = N of fprop):

    tensor         shape        FP8 dtype (hybrid)  used by
    x              (T, in)      E4M3                fprop A
    x^T            (in, T)      E4M3                wgrad B        <- saved for backward (1 byte/elem)
    W              (out, in)    E4M3                fprop B        <- cached once per optimizer step
    W^T            (in, out)    E4M3                dgrad B        <- cached with W
    dY             (T, out)     E5M2                dgrad A
    dY^T           (out, T)     E5M2                wgrad A

    fprop  Y  = x  @ W^T   = fp8_gemm(x,    W)
    dgrad  dX = dY @ W     = fp8_gemm(dY,   W^T)
    wgrad  dW = dY^T @ x   = fp8_gemm(dY^T, x^T)   (optionally += into weight.main_grad, fp32)

Every GEMM operand is K-major, which Hopper's FP8 tensor cores require; the transposed copies come
from the quantizer's fused cast+transpose. Forward saves x^T in FP8 (not the high-precision input):
half the activation memory of a BF16 linear. The FP8 weight is held by the module, not by autograd.

Under sequence parallelism (a SequenceParallelInput given by the tensor-parallel layer) x arrives as
this rank's sequence shard: it is quantized once, its FP8 bytes + scales are all-gathered, and dgrad's
full-sequence result is reduce-scattered back to the shard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megafp8_kernels import Granularity, fp8_format, fp8_gemm, quantize, scale_from_amax

from .autocast import resolve_recipe
from .recipe import ROLES, Fp8Recipe
from .scaling_state import ScalingState
from .telemetry import record_fp8_stats
from .tensor import Float8Tensor


class SequenceParallelInput(Protocol):
    """How a column-parallel layer under sequence parallelism moves its FP8 input; megafp8.parallel
    implements it over the TP group. Rows are tokens, sequence-major, so gathering rows gathers the sequence."""

    def sync_amax(self, amax: torch.Tensor) -> None:
        """In-place MAX over the group (current tensorwise scaling needs one scale on every rank)."""

    def gather_rows(self, x: Float8Tensor) -> Float8Tensor:
        """All-gather the row-major FP8 bytes and their scales: 1 byte per element on the wire."""

    def reduce_scatter_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum the full-sequence dgrad over the group and keep this rank's rows."""


def _quantize(x2d: torch.Tensor, recipe: Fp8Recipe, role: str, state: ScalingState | None, transpose: bool,
              layer: Fp8Linear, scale: torch.Tensor | None = None) -> Float8Tensor:
    """Quantize one operand by the recipe; delayed scaling uses and feeds the role's ScalingState."""
    gran = recipe.granularity(role)
    if scale is None and state is not None:
        scale = state.scale
    q = quantize(x2d, recipe.dtype(role), gran, power_of_2_scale=recipe.power_of_2_scale, scale=scale,
                 transpose=transpose)
    if state is not None:
        state.observe(q.amax)
    fp8 = Float8Tensor.from_quantized(q, gran)
    if layer.telemetry_enabled:
        record_fp8_stats(layer, role, x2d, fp8, q.amax)
    return fp8


def _quantize_input(x2d: torch.Tensor, recipe: Fp8Recipe, layer: Fp8Linear, needs_wgrad: bool,
                    sp_input: SequenceParallelInput | None) -> Float8Tensor:
    """The FP8 input of fprop (row-major) and, for wgrad, its transposed copy."""
    state = layer.scaling_state("input", recipe)
    if sp_input is None:
        return _quantize(x2d, recipe, "input", state, needs_wgrad, layer)
    # Sequence parallel: quantize this rank's rows ONCE and all-gather the FP8 bytes, not BF16.
    gran = recipe.granularity("input")
    scale = None
    if state is None and gran is Granularity.TENSORWISE:  # current scaling: agree on one scale first
        amax = x2d.detach().abs().amax().float()
        sp_input.sync_amax(amax)
        scale = scale_from_amax(amax, fp8_format(recipe.dtype("input")).max, recipe.power_of_2_scale)
    full = sp_input.gather_rows(_quantize(x2d, recipe, "input", state, False, layer, scale=scale))
    if not needs_wgrad:
        return full
    if gran is Granularity.TENSORWISE:  # one scale: the transposed copy is the same bytes, moved
        return dataclasses.replace(full, data_t=full.data.t().contiguous(), scale_inv_t=full.scale_inv)
    # Row/1x128 groups of the transposed copy span every rank's rows: re-quantize the gathered FP8
    # values along the other axis (a second rounding of already-FP8 values, instead of gathering twice).
    q = quantize(full.dequantize(), full.fp8_dtype, gran, power_of_2_scale=recipe.power_of_2_scale, transpose=True)
    return dataclasses.replace(full, data_t=q.data_t, scale_inv_t=q.scale_inv_t)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_fp8: Float8Tensor, recipe: Fp8Recipe, layer: Fp8Linear,
                sp_input: SequenceParallelInput | None):
        x2d = x.reshape(-1, x.shape[-1])
        needs_wgrad = ctx.needs_input_grad[1]  # grad mode is off inside forward; ask autograd instead
        x_fp8 = _quantize_input(x2d, recipe, layer, needs_wgrad, sp_input)
        y = fp8_gemm_operands(x_fp8.row_major(), weight_fp8.row_major(), x.dtype, bias)

        ctx.recipe, ctx.layer, ctx.weight_fp8 = recipe, layer, weight_fp8  # the module owns the FP8 weight
        ctx.sp_input, ctx.x_dtype, ctx.x_shape = sp_input, x.dtype, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if needs_wgrad:
            x_t, x_scale_t = x_fp8.col_major()  # only the transposed FP8 bytes survive forward
            ctx.save_for_backward(x_t, x_scale_t, weight)
            ctx.x_granularity = x_fp8.granularity
        else:
            ctx.save_for_backward(None, None, weight)
        return y.view(-1, *x.shape[1:-1], y.shape[-1])  # dim 0 grows by the TP size under sequence parallel

    @staticmethod
    def backward(ctx, grad_output):
        x_t, x_scale_t, weight = ctx.saved_tensors
        recipe, layer = ctx.recipe, ctx.layer
        dy2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_fp8 = _quantize(dy2d, recipe, "grad_output", layer.scaling_state("grad_output", recipe), needs_wgrad, layer)

        # ---- dgrad: dX = dY @ W ----
        grad_input = None
        if needs_dgrad:
            grad_input = fp8_gemm_operands(dy_fp8.row_major(), ctx.weight_fp8.col_major(), ctx.x_dtype)
            if ctx.sp_input is not None:
                grad_input = ctx.sp_input.reduce_scatter_rows(grad_input)
            grad_input = grad_input.view(ctx.x_shape)

        # ---- wgrad: dW = dY^T @ x ----
        grad_weight = None
        if needs_wgrad:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is not None:
                # Accumulate across micro-batches straight into the fp32 buffer the optimizer reads.
                fp8_gemm_operands(dy_fp8.col_major(), (x_t, x_scale_t), torch.float32, out=main_grad)
            else:
                grad_weight = fp8_gemm_operands(dy_fp8.col_major(), (x_t, x_scale_t), weight.dtype)

        grad_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = dy2d.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def fp8_gemm_operands(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_gemm on (data, scale_inv) pairs; with `out` the product is accumulated into it."""
    return fp8_gemm(a[0], b[0], a[1], b[1], out_dtype=out_dtype, bias=bias, out=out, accumulate=out is not None)


class Fp8Linear(nn.Module):
    """y = x W^T + b with the three GEMMs in FP8 when a recipe is active, else in the input's precision.

    recipe:              this layer's own recipe (per-layer override); None = follow fp8_autocast
    force_high_precision: run in high precision whatever the recipe (precision map, saturation guard)
    forward(x, input_channel_scale=s): Smooth-SwiGLU — quantize x*s and fold 1/s into W's columns, so
                          the product is unchanged while x's outlier channels no longer set its FP8 scale.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Fp8Recipe | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.recipe = recipe
        self.force_high_precision = False
        self.telemetry_enabled = False
        self.fp8_telemetry: dict[str, dict[str, torch.Tensor]] = {}
        self.fp8_scaling = nn.ModuleDict()
        if recipe is not None and recipe.is_delayed:
            self._make_scaling_states(recipe)
        self._weight_cache: tuple[tuple, Float8Tensor] | None = None
        self.weight_quantizations = 0  # how often the FP8 weight was (re)built: once per step expected

    # ---- recipe, scaling state and weight cache ----
    def set_recipe(self, recipe: Fp8Recipe) -> None:
        if recipe != self.recipe:
            self.recipe = recipe
            self.invalidate_weight_cache()
            if recipe.is_delayed:
                self._make_scaling_states(recipe)

    def _make_scaling_states(self, recipe: Fp8Recipe) -> None:
        for role in ROLES:
            self.fp8_scaling[role] = ScalingState(recipe, recipe.dtype(role)).to(self.weight.device)

    def scaling_state(self, role: str, recipe: Fp8Recipe) -> ScalingState | None:
        if not recipe.is_delayed:
            return None
        if role not in self.fp8_scaling or self.fp8_scaling[role].recipe != recipe:
            self._make_scaling_states(recipe)  # recipe came from fp8_autocast: allocate on first use
        return self.fp8_scaling[role]

    def fp8_weight(self, recipe: Fp8Recipe, weight: torch.Tensor | None = None) -> Float8Tensor:
        """The weight in FP8, quantized once per optimizer step and reused by every micro-batch.

        The cache is keyed on the parameter's version counter (bumped by in-place optimizer updates)
        and dropped by invalidate_fp8_weight_caches (called by Fp8ScalingManager.update each step).
        A `weight` other than the parameter (Smooth-SwiGLU's rescaled one) is never cached."""
        transpose = torch.is_grad_enabled()
        if weight is not None:
            return self._quantize_weight(weight, recipe, transpose)
        key = (self.weight._version, self.weight.data_ptr(), recipe, transpose)
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = (key, self._quantize_weight(self.weight, recipe, transpose))
        return self._weight_cache[1]

    def _quantize_weight(self, weight: torch.Tensor, recipe: Fp8Recipe, transpose: bool) -> Float8Tensor:
        self.weight_quantizations += 1
        with torch.no_grad():
            return _quantize(weight.detach(), recipe, "weight", self.scaling_state("weight", recipe), transpose, self)

    def invalidate_weight_cache(self) -> None:
        self._weight_cache = None

    # ---- forward ----
    def forward(self, x: torch.Tensor, input_channel_scale: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight
        if input_channel_scale is not None:
            s = input_channel_scale.to(x.dtype)
            x, weight = x * s, weight / s  # exact when s is a power of two (smooth_swiglu_channel_scales)
        recipe = resolve_recipe(self.recipe, self.force_high_precision)
        if recipe is None:
            return F.linear(x, weight, self.bias)
        weight_fp8 = self.fp8_weight(recipe, weight if input_channel_scale is not None else None)
        return _Fp8LinearFunction.apply(x, weight, self.bias, weight_fp8, recipe, self, None)

    def extra_repr(self) -> str:
        recipe = "autocast" if self.recipe is None else self.recipe.scaling
        hp = ", high precision" if self.force_high_precision else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, recipe={recipe}{hp}"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_fp8: Float8Tensor,
               recipe: Fp8Recipe, layer: Fp8Linear, sp_input: SequenceParallelInput | None = None) -> torch.Tensor:
    """The FP8 linear autograd op on its own, for tensor-parallel layers. With `sp_input` the input is
    this rank's sequence shard: it is quantized, all-gathered as FP8, and dgrad is reduce-scattered back."""
    return _Fp8LinearFunction.apply(x, weight, bias, weight_fp8, recipe, layer, sp_input)


def invalidate_fp8_weight_caches(model: nn.Module) -> None:
    """Drop every cached FP8 weight (after an optimizer step that wrote weights without bumping versions)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.invalidate_weight_cache()
