"""The FP8 linear autograd op: fprop, dgrad and wgrad GEMMs all in FP8, with FP8 copies saved for backward.

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
half the activation memory of a BF16 linear. The FP8 weight is held by the module (linear.py), not by autograd.

Under sequence parallelism (a SequenceParallelComm given by the tensor-parallel layer) every tensor
that crosses the TP group in a gather crosses it in FP8: a column-parallel layer's input shard is
quantized once and its FP8 bytes + scales are all-gathered (dgrad is reduce-scattered back); a
row-parallel layer's output is reduce-scattered and, in backward, its output-gradient shard is
quantized once and all-gathered in FP8 for dgrad and wgrad.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from megafp8_kernels import Granularity, fp8_format, fp8_gemm, quantize, scale_from_amax

from .recipe import Fp8Recipe
from .scaling_state import ScalingState
from .telemetry import record_fp8_stats
from .tensor import Float8Tensor

if TYPE_CHECKING:
    from .linear import Fp8GemmModule


class SequenceParallelComm(Protocol):
    """How a tensor-parallel layer under sequence parallelism moves FP8 operands; megafp8.parallel
    implements it over the TP group. Rows are tokens, sequence-major, so gathering rows gathers the
    sequence. A column-parallel layer gathers its input (forward); a row-parallel layer reduce-scatters
    its output (forward) and gathers its output gradient (backward)."""

    def sync_amax(self, amax: torch.Tensor) -> None:
        """In-place MAX over the group (current tensorwise scaling needs one scale on every rank)."""

    def gather_rows(self, x: Float8Tensor) -> Float8Tensor:
        """All-gather the row-major FP8 bytes and their scales: 1 byte per element on the wire."""

    def reduce_scatter_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a full-sequence tensor over the group and keep this rank's rows (high precision)."""


def quantize_operand(x2d: torch.Tensor, recipe: Fp8Recipe, role: str, state: ScalingState | None, transpose: bool,
                     layer: Fp8GemmModule, scale: torch.Tensor | None = None) -> Float8Tensor:
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


def _quantize_maybe_gathered(x2d: torch.Tensor, recipe: Fp8Recipe, role: str, layer: Fp8GemmModule,
                             transpose: bool, comm: SequenceParallelComm | None) -> Float8Tensor:
    """The FP8 operand (row-major, plus its transposed copy if asked); with `comm`, x2d is this rank's
    sequence shard, quantized ONCE and all-gathered as FP8 bytes (not BF16)."""
    state = layer.scaling_state(role, recipe)
    if comm is None:
        return quantize_operand(x2d, recipe, role, state, transpose, layer)
    gran = recipe.granularity(role)
    scale = None
    if state is None and gran is Granularity.TENSORWISE:  # current scaling: agree on one scale first
        amax = x2d.detach().abs().amax().float()
        comm.sync_amax(amax)
        scale = scale_from_amax(amax, fp8_format(recipe.dtype(role)).max, recipe.power_of_2_scale)
    full = comm.gather_rows(quantize_operand(x2d, recipe, role, state, False, layer, scale=scale))
    if not transpose:
        return full
    if gran is Granularity.TENSORWISE:  # one scale: the transposed copy is the same bytes, moved
        return dataclasses.replace(full, data_t=full.data.t().contiguous(), scale_inv_t=full.scale_inv)
    # Row/1x128 groups of the transposed copy span every rank's rows: re-quantize the gathered FP8
    # values along the other axis (a second rounding of already-FP8 values, instead of gathering twice).
    q = quantize(full.dequantize(), full.fp8_dtype, gran, power_of_2_scale=recipe.power_of_2_scale, transpose=True)
    return dataclasses.replace(full, data_t=q.data_t, scale_inv_t=q.scale_inv_t)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_fp8: Float8Tensor, recipe: Fp8Recipe, layer: Fp8GemmModule,
                sp_input: SequenceParallelComm | None, sp_output: SequenceParallelComm | None):
        x2d = x.reshape(-1, x.shape[-1])
        needs_wgrad = ctx.needs_input_grad[1]  # grad mode is off inside forward; ask autograd instead
        x_fp8 = _quantize_maybe_gathered(x2d, recipe, "input", layer, needs_wgrad, sp_input)
        y = fp8_gemm_operands(x_fp8.row_major(), weight_fp8.row_major(), x.dtype, bias)
        if sp_output is not None:
            y = sp_output.reduce_scatter_rows(y)  # row-parallel partial sums -> this rank's sequence shard

        ctx.recipe, ctx.layer, ctx.weight_fp8 = recipe, layer, weight_fp8  # the module owns the FP8 weight
        ctx.sp_input, ctx.sp_output, ctx.x_dtype, ctx.x_shape = sp_input, sp_output, x.dtype, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if needs_wgrad:
            x_t, x_scale_t = x_fp8.col_major()  # only the transposed FP8 bytes survive forward
            ctx.save_for_backward(x_t, x_scale_t, weight)
        else:
            ctx.save_for_backward(None, None, weight)
        return y.view(-1, *x.shape[1:-1], y.shape[-1])  # dim 0 changes by the TP size under sequence parallel

    @staticmethod
    def backward(ctx, grad_output):
        x_t, x_scale_t, weight = ctx.saved_tensors
        recipe, layer = ctx.recipe, ctx.layer
        dy2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_fp8 = _quantize_maybe_gathered(dy2d, recipe, "grad_output", layer, needs_wgrad, ctx.sp_output)

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
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def fp8_gemm_operands(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_gemm on (data, scale_inv) pairs; with `out` the product is accumulated into it."""
    return fp8_gemm(a[0], b[0], a[1], b[1], out_dtype=out_dtype, bias=bias, out=out, accumulate=out is not None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_fp8: Float8Tensor,
               recipe: Fp8Recipe, layer: Fp8GemmModule, sp_input: SequenceParallelComm | None = None,
               sp_output: SequenceParallelComm | None = None) -> torch.Tensor:
    """The FP8 linear autograd op. Sequence parallelism (tensor-parallel layers):
    sp_input   x is this rank's sequence shard: quantized once, all-gathered as FP8; dgrad is reduce-scattered.
    sp_output  the output partial sums are reduce-scattered to this rank's shard; in backward the output
               gradient shard is quantized once and all-gathered as FP8 for dgrad and wgrad."""
    if sp_output is not None and bias is not None:
        raise ValueError("a bias inside a reduce-scattered GEMM would be summed once per rank: add it after")
    return _Fp8LinearFunction.apply(x, weight, bias, weight_fp8, recipe, layer, sp_input, sp_output)
