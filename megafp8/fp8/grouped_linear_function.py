"""The local experts' FP8 linears as grouped GEMMs (``--moe-grouped-gemm`` with FP8 experts): fprop, dgrad and wgrad
are one grouped FP8 GEMM each over every local expert (megafp8_kernels.grouped_gemm).

Each expert's operands are quantized by its own linear, exactly as the loop of linear_function's op does: its
recipe's quantizers, its delayed-scaling states, its cached (or ZeRO-injected) FP8 weight, its telemetry counts (so
the saturation guard watches every expert as in the loop). Only the GEMMs are grouped: the experts' FP8 rows
concatenated (their scales expanded to rows where the recipe scales a whole tensor), their FP8 weights stacked, their
transposed copies laid side by side for wgrad.

    fprop  Y_e  = X_e  @ W_e^T     grouped by rows (rows of expert e x its weight)
    dgrad  dX_e = dY_e @ W_e       grouped by rows (its weight's transposed copy)
    wgrad  dW_e = dY_e^T @ X_e     grouped along K (the expert's tokens, each padded to 128 zero columns), into one
                                   (E, out, in) fp32 result, then added to each weight's main_grad: a transient the
                                   size of the experts' fp32 gradients, where the loop accumulates inside each GEMM

It runs the recipes whose three GEMMs the grouped kernels have (tensorwise, delayed, rowwise, blockwise); the others
(MX, NVFP4), Smooth-SwiGLU's per-input weight, a zero-bubble schedule's deferred wgrad, and the probes that read a
linear's input in high precision (kurtosis, the FP4 grad-noise probe, the forced-overflow hook) keep the loop
(``grouped_fp8_ready``). On CPU the grouped GEMMs' twins are the loop's own GEMMs, so both paths give the same bits.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from megafp8_kernels import GemmScaleMode
from megafp8_kernels.formats import PER_ROW, PER_TENSOR
from megafp8_kernels.grouped_gemm import (GROUPED_MODES, GROUPED_WGRAD_MODES, columns_side_by_side, grouped_fp8_gemm,
                                          grouped_fp8_wgrad)

from .linear import Fp8GemmModule
from .linear_function import quantize_operand, route_grad
from .recipe import Fp8Recipe
from .tensor import Float8Tensor


def _kernel_layout(layout):
    """The layout a grouped kernel takes for an operand: a whole tensor's one scale arrives expanded to its rows."""
    return PER_ROW if layout == PER_TENSOR else layout


def _grouped_mode(recipe: Fp8Recipe, role_a: str, role_b: str, modes: tuple) -> GemmScaleMode | None:
    """The grouped kernels' mode (one of ``modes``) for the GEMM of these two roles' operands, or None."""
    a, b = recipe.quantizer(role_a), recipe.quantizer(role_b)
    if a.format.bits != 8 or b.format.bits != 8 or (a.layout == PER_TENSOR) != (b.layout == PER_TENSOR):
        return None
    layouts = (_kernel_layout(a.layout), _kernel_layout(b.layout))
    try:
        mode = GemmScaleMode.declared(*layouts)
    except ValueError:
        return None
    return mode if mode in modes else None


def grouped_fp8_ready(linears: list[Fp8GemmModule]) -> Fp8Recipe | None:
    """The recipe all these linears run now, if the grouped FP8 path runs them as the loop would; else None."""
    recipes = {linear.active_recipe for linear in linears}
    if len(recipes) != 1:
        return None
    (recipe,) = recipes
    if recipe is None or recipe.fprop_high_precision or recipe.is_microscaled:
        return None
    gemms = (("input", "weight", GROUPED_MODES), ("grad_output", "weight", GROUPED_MODES),
             ("grad_output", "input", GROUPED_WGRAD_MODES))  # fprop, dgrad, wgrad (the transposed copies)
    if any(_grouped_mode(recipe, *gemm) is None for gemm in gemms):
        return None
    if any(linear.kurtosis_enabled or linear.grad_noise_probe is not None or linear.forced_overflow_factor is not None
           or linear.wgrad_deferral is not None or linear.smooths_input or getattr(linear, "bias", None) is not None
           or getattr(linear, "output_multiplier", None) is not None or _split(linear) for linear in linears):
        return None
    return recipe


def _split(linear: Fp8GemmModule) -> bool:
    """Whether the linear is split over ranks (its op then moves operands over its group): whole experts only."""
    tp = getattr(linear, "tp", None)
    return tp is not None and tp.size > 1


def _rows_operand(parts: list[Float8Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' FP8 rows one after another, and their scales per row (a tensor's one scale repeated)."""
    data = torch.cat([p.data for p in parts])
    if parts[0].layout == PER_TENSOR:
        return data, torch.cat([p.scale_inv.reshape(1).expand(p.shape[0]) for p in parts]).unsqueeze(1)
    return data, torch.cat([p.scale_inv for p in parts])


def _stacked_operand(parts: list[Float8Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' FP8 weights stacked (G, N, K), and their scales (G, ...) (a tensor's one scale per row)."""
    data = torch.stack([p.data for p in parts])
    if parts[0].layout == PER_TENSOR:
        return data, torch.stack([p.scale_inv.reshape(1, 1).expand(p.shape[0], 1) for p in parts])
    return data, torch.stack([p.scale_inv for p in parts])


def _side_by_side_operand(parts: list[Float8Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' transposed copies side by side for the grouped wgrad (each padded to 128 tokens), and their scales:
    each expert's own per-row ones stacked (a tensor's one scale repeated), or the 1x128 token groups' concatenated
    along the padded tokens."""
    copies = [p.col_major() for p in parts]
    data = columns_side_by_side([payload for payload, _ in copies])
    if parts[0].layout == PER_TENSOR:
        return data, torch.stack([scale.reshape(1, 1).expand(data.shape[0], 1) for _, scale in copies])
    if parts[0].layout == PER_ROW:
        return data, torch.stack([scale for _, scale in copies])
    return data, torch.cat([scale for _, scale in copies], dim=1)


def _grouped_gemm(rows: list[Float8Tensor], weights: list[Float8Tensor], ends: torch.Tensor, out_dtype: torch.dtype,
                  fast_accum: bool = False) -> torch.Tensor:
    a, scale_a = _rows_operand(rows)
    b, scale_b = _stacked_operand(weights)
    layouts = (_kernel_layout(rows[0].layout), _kernel_layout(weights[0].layout))
    return grouped_fp8_gemm(a, b, scale_a, scale_b, ends, layouts=layouts, out_dtype=out_dtype,
                            fast_accum=fast_accum and layouts[0] == PER_ROW)


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """Each expert's row count (padded as the loop pads them), on the host and, once per MoE layer call for its two
    linears, on the device: ``ends`` (cumulative) for fprop and dgrad, ``counts`` for wgrad."""

    sizes: tuple[int, ...]
    ends: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, sizes: list[int], device: torch.device) -> ExpertRows:
        """One copy to the device, from pinned memory and not waited for on CUDA (no host sync)."""
        cuda = device.type == "cuda"
        host = torch.tensor([*itertools.accumulate(sizes), *sizes], dtype=torch.int32, pin_memory=cuda)
        both = host.to(device, non_blocking=cuda)
        return cls(tuple(sizes), both[:len(sizes)], both[len(sizes):])


@dataclasses.dataclass(frozen=True)
class GroupedArgs:
    """The non-tensor inputs of one grouped call: the experts' linears, their recipe, their rows, their FP8 weights for
    this step, and whether to feed delayed-scaling histories."""

    recipe: Fp8Recipe
    linears: tuple[Fp8GemmModule, ...]
    rows: ExpertRows
    weights_fp8: tuple[Float8Tensor, ...]
    observe: bool


class _GroupedFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, args: GroupedArgs, *weights: torch.Tensor) -> torch.Tensor:
        needs_wgrad = any(ctx.needs_input_grad[2:])
        sizes = args.rows.sizes
        parts = [quantize_operand(chunk, args.recipe, "input", linear.scaling_state("input", args.recipe),
                                  needs_wgrad, linear, observe=args.observe)
                 for chunk, linear in zip(rows.split(sizes), args.linears)]
        y = _grouped_gemm(parts, list(args.weights_fp8), args.rows.ends, rows.dtype, args.recipe.fast_accum("fprop"))
        ctx.args, ctx.x_dtype, ctx.x_kind = args, rows.dtype, (parts[0].format, parts[0].layout)
        # The leaves themselves: under recomputation (torch.utils.checkpoint) a saved copy of a weight is another
        # object, without its main_grad.
        ctx.weight_params = weights
        ctx.save_for_backward(*(t for p in parts for t in p.col_major()) if needs_wgrad else ())  # x^T in FP8
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        args, x_t = ctx.args, ctx.saved_tensors
        needs_weight_grad = ctx.needs_input_grad[2:]
        needs_wgrad = any(needs_weight_grad)
        dy = grad_output.contiguous()
        dy_parts = [quantize_operand(chunk, args.recipe, "grad_output",
                                     linear.scaling_state("grad_output", args.recipe), needs_wgrad, linear,
                                     observe=args.observe)
                    for chunk, linear in zip(dy.split(args.rows.sizes), args.linears)]
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = _grouped_gemm(dy_parts, [w.t() for w in args.weights_fp8], args.rows.ends, ctx.x_dtype)
        grad_weights = [None] * len(ctx.weight_params)
        if needs_wgrad:
            x_format, x_layout = ctx.x_kind
            x_parts = [Float8Tensor((n, x_t[2 * e].shape[0]), x_format, x_layout, data_t=x_t[2 * e],
                                    scale_inv_t=x_t[2 * e + 1]) for e, n in enumerate(args.rows.sizes)]
            dy_t, dy_scale = _side_by_side_operand(dy_parts)
            x_t_all, x_scale = _side_by_side_operand(x_parts)
            layouts = (_kernel_layout(dy_parts[0].layout), _kernel_layout(x_parts[0].layout))
            grads = grouped_fp8_wgrad(dy_t, x_t_all, dy_scale, x_scale, args.rows.counts, layouts=layouts)
            # Only where autograd asks (a frozen expert's main_grad stays as it is, as in the loop).
            grad_weights = [route_grad(weight, grad) if needed else None
                            for weight, grad, needed in zip(ctx.weight_params, grads, needs_weight_grad)]
        return grad_rows, None, *grad_weights


def grouped_fp8_linear(rows: torch.Tensor, expert_rows: ExpertRows, linears: list[Fp8GemmModule],
                       recipe: Fp8Recipe) -> torch.Tensor:
    """``rows [sum(sizes), in]``, expert e's ``sizes[e]`` rows after the ones before it -> ``[sum(sizes), out]``, each
    expert's rows through its linear in FP8 (``recipe``: ``grouped_fp8_ready``); the weights' gradients go where the
    loop's go (``main_grad`` when it exists)."""
    grad = torch.is_grad_enabled()
    observe = grad and all(linear.training for linear in linears)  # evaluation leaves the scaling state alone
    weights = [linear.weight for linear in linears]
    weights_fp8 = tuple(linear.fp8_weight(recipe, weight, observe) for linear, weight in zip(linears, weights))
    if not grad:
        rows, weights = rows.detach(), [w.detach() for w in weights]
    args = GroupedArgs(recipe, tuple(linears), expert_rows, weights_fp8, observe)
    return _GroupedFp8Linear.apply(rows, args, *weights)
