"""The FP8 linear autograd op: fprop, dgrad and wgrad GEMMs all in FP8, with FP8 copies saved for backward.

Shapes (T tokens = all leading dims flattened, in = K of fprop, out = N of fprop):

    tensor         shape        FP8 dtype (hybrid)  used by
    x              (T, in)      E4M3                fprop A
    x^T            (in, T)      E4M3                wgrad B        <- saved for backward (1 byte/elem)
    W              (out, in)    E4M3                fprop B        <- held by the module, once per step
    W^T            (in, out)    E4M3                dgrad B        <- held with W
    dY             (T, out)     E5M2                dgrad A
    dY^T           (out, T)     E5M2                wgrad A

    fprop  Y  = x  @ W^T   = fp8_gemm(x,    W)
    dgrad  dX = dY @ W     = fp8_gemm(dY,   W^T)
    wgrad  dW = dY^T @ x   = fp8_gemm(dY^T, x^T)   (routed into weight.main_grad when it exists)

Every GEMM operand is K-major, which Hopper's FP8 tensor cores require; the transposed copies come
from the quantizer's fused cast+transpose. Forward saves x^T in FP8 (not the high-precision input):
half the activation memory of a BF16 linear. The FP8 weight is held by the module (linear.py), not by
autograd; the op also receives the leaf Parameter, only to route its gradient.

Gradient routing: if a parameter (weight or bias) has `main_grad` (any float dtype), its gradient is
added there in fp32 and the op returns None for it, so `.grad` stays None (Megatron's gradient-
accumulation fusion). In a zero-bubble pipeline's B pass (`layer.wgrad_deferral` active, deferred_wgrad.py)
the wgrad GEMM is queued with its FP8 operands and run in the W pass instead. Smooth-SwiGLU hands the op the FP8 copy of W / s and `wgrad_column_scale = 1/s`:
the wgrad of W / s times 1/s per column (exact for powers of two) is the wgrad of the leaf W.

Under sequence parallelism (a SequenceParallelComm given by the tensor-parallel layer) every tensor
that crosses the TP group in a gather crosses it in FP8: a column-parallel layer's input shard is
quantized once and its FP8 bytes + scales are all-gathered in one collective; forward saves only this
rank's shard of x^T (quantized from the high-precision shard with the scale groups of the full
sequence, so it is bit-identical to the TP=1 copy) and backward re-gathers it while dgrad runs, then
runs wgrad while dgrad's reduce-scatter is in flight. A fused RMSNorm prologue casts the shard itself
wherever every scale group of that cast lies in the shard (_fuses_sequence_shard: a warm delayed scale,
1x128 groups with 128-aligned shards). A row-parallel layer reduce-scatters its output and, in backward,
quantizes its output-gradient shard once and all-gathers it for dgrad and wgrad. Without sequence
parallelism a column-parallel layer all-reduces dgrad itself (`tp_input`), also overlapped with wgrad.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from megafp8_kernels import scaled_gemm

from .forced_overflow import overflowing_scale
from .prologue import InputPrologue
from .quantizer import Quantized, Quantizer, TransposedShard
from .recipe import Fp8Recipe
from .kurtosis import record_input_moments
from .telemetry import record_fp8_stats
from .tensor import Float8Tensor

if TYPE_CHECKING:
    from .linear import Fp8GemmModule
    from .scaling_state import ScalingState


class Pending(Protocol):
    """A collective in flight; wait() returns its result."""

    def wait(self): ...


class SequenceParallelComm(Protocol):
    """How a tensor-parallel layer moves FP8 operands over its TP group; megafp8.parallel implements it.
    Rows are tokens, sequence-major, so gathering rows gathers the sequence. A column-parallel layer
    gathers its input (forward) and re-gathers its saved x^T shard (backward); a row-parallel layer
    reduce-scatters its output (forward) and gathers its output gradient (backward)."""

    size: int  # TP ranks
    rank: int  # this rank's index: its rows are [rank * rows, (rank + 1) * rows) of the gathered tensor

    def sync_amax(self, amax: torch.Tensor) -> None:
        """In-place MAX over the group (current scaling of a gathered tensor needs one scale per group)."""

    def gather_rows_async(self, x: Float8Tensor) -> Pending:
        """All-gather the row-major FP8 bytes and their scales (one collective); wait() -> Float8Tensor."""

    def gather_cols_async(self, data_t: torch.Tensor) -> Pending:
        """All-gather (in, T/TP) FP8 bytes along dim 1 (scales already agree); wait() -> (in, T)."""

    def reduce_scatter_rows_async(self, t: torch.Tensor) -> Pending:
        """Sum a full-sequence tensor over the group and keep this rank's rows (high precision)."""

    def all_reduce_async(self, t: torch.Tensor) -> Pending:
        """Sum over the group in place (dgrad of a column-parallel layer without sequence parallelism)."""


@dataclasses.dataclass(frozen=True)
class Fp8LinearArgs:
    """The non-tensor inputs of one FP8 linear call.

    observe: fold this call's amaxes into delayed-scaling histories (training forward only: an eval or
             no-grad forward must leave the scaling state untouched).
    prologue: the op's input x is the prologue's input: the GEMM consumes prologue(x) (prologue.py)."""

    recipe: Fp8Recipe
    layer: Fp8GemmModule
    sp_input: SequenceParallelComm | None = None
    sp_output: SequenceParallelComm | None = None
    tp_input: SequenceParallelComm | None = None
    observe: bool = True
    wgrad_column_scale: torch.Tensor | None = None
    prologue: InputPrologue | None = None


class _Done:
    """An already finished 'collective' (no communication needed)."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


def delayed_scale(state: ScalingState | None) -> torch.Tensor | None:
    """The delayed scale to quantize with, or None for current scaling: no state, or a state whose amax
    history is still empty (cold start: its initial scale 1.0 would flush small gradients to zero)."""
    if state is None or state.is_cold:
        return None
    return state.scale


def known_scale(quantizer: Quantizer, state: ScalingState | None, device: torch.device) -> torch.Tensor | None:
    """The scale known before the cast: a warm delayed state's, or a static recipe's fixed one (None: current
    scaling from this tensor's amax)."""
    scale = delayed_scale(state)
    return scale if scale is not None else quantizer.fixed_scale(device)


def _observed(q: Quantized, role: str, state: ScalingState | None, layer: Fp8GemmModule, observe: bool) -> Float8Tensor:
    """A quantizer's result after its bookkeeping: the amax into the role's delayed state (if `observe`), the cast's
    counts into the layer's telemetry."""
    if state is not None and observe:
        state.observe(q.amax)
    if layer.telemetry_enabled:
        record_fp8_stats(layer, role, q.tensor, q.counts, q.amax)
    return q.tensor


def quantize_operand(x2d: torch.Tensor, recipe: Fp8Recipe, role: str, state: ScalingState | None, transpose: bool,
                     layer: Fp8GemmModule, scale: torch.Tensor | None = None, observe: bool = True) -> Float8Tensor:
    """Quantize one operand with the recipe's quantizer for its role; delayed scaling uses the role's ScalingState
    and, if `observe`, feeds it this tensor's amax."""
    quantizer = recipe.quantizer(role)
    if scale is None:
        scale = known_scale(quantizer, state, x2d.device)
    if scale is None and state is not None:
        scale = _cold_shard_scale(x2d, quantizer, layer)
    if role == "input" and layer.forced_overflow_factor is not None:  # a test hook (forced_overflow.py)
        scale = overflowing_scale(x2d, scale, quantizer.format.dtype, quantizer.granularity,
                                  quantizer.power_of_2_scale, layer.forced_overflow_factor)
    key = layer.next_rounding_key(role) if quantizer.stochastic else None
    q = quantizer.quantize(x2d, scale=scale, transpose=transpose, stats=layer.telemetry_enabled, key=key)
    return _observed(q, role, state, layer, observe)


def _fused_prologue_input(x: torch.Tensor, params: tuple[torch.Tensor, ...], args: Fp8LinearArgs,
                          transpose: bool) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
    """prologue(x) quantized by one fused kernel (+ what the prologue's backward needs), or None where the input
    quantization needs prologue(x) in high precision: a quantizer without a fused kernel, with the forced-overflow hook
    on (it reads it), for a cold
    delayed state of a TP-sharded input (whole-tensor amax), and under SP where the shard's cast is not local
    (Quantizer.fuses_sequence_shard). Telemetry stays fused: the kernel counts the cast's saturated/flushed elements."""
    recipe, layer = args.recipe, args.layer
    quantizer = recipe.quantizer("input")
    if layer.forced_overflow_factor is not None or not quantizer.has_fused_prologue:
        return None
    state = layer.scaling_state("input", recipe)
    scale = known_scale(quantizer, state, x.device)
    x2d = x.reshape(-1, x.shape[-1])
    if args.sp_input is not None and not quantizer.fuses_sequence_shard(x2d.shape[0], scale, transpose):
        return None
    if state is not None and scale is None and layer.sharded_amax_sync() is not None:
        return None
    q, extras = quantizer.quantize_with_prologue(args.prologue, x2d, params, scale=scale, transpose=transpose,
                                                 stats=layer.telemetry_enabled)
    return _observed(q, "input", state, layer, args.observe), extras


def _cold_shard_scale(x2d: torch.Tensor, quantizer: Quantizer, layer: Fp8GemmModule) -> torch.Tensor | None:
    """A cold delayed state's current scale for a tensor sharded over TP (weights, a row-parallel input, a
    column-parallel output gradient): from the MAX of the shards' amaxes, so the first step quantizes as
    the TP=1 run does and the amaxes it hands to update() match TP=1's. A local amax gave each rank its own
    scale (no desync: these tensors are never gathered, but the step differed from TP=1, and every delayed
    scale after the first update() by up to 5%). One scalar all-reduce per tensor, in cold steps only."""
    sync = layer.sharded_amax_sync()
    if sync is None:
        return None  # whole tensor (or TP=1): the quantizer takes this tensor's amax itself
    amax = x2d.detach().abs().amax().float()
    sync(amax)
    return quantizer.scale_from_amax(amax)


def _gather_quantized(x2d: torch.Tensor, recipe: Fp8Recipe, role: str, layer: Fp8GemmModule,
                      comm: SequenceParallelComm, observe: bool) -> tuple[Pending, Float8Tensor]:
    """Quantize this rank's sequence shard ONCE and start gathering its FP8 bytes (not BF16)."""
    state = layer.scaling_state(role, recipe)
    quantizer = recipe.quantizer(role)
    scale = quantizer.agreed_scale(x2d, known_scale(quantizer, state, x2d.device), comm)
    local = quantize_operand(x2d, recipe, role, state, False, layer, scale=scale, observe=observe)
    return comm.gather_rows_async(local), local


def _transposed_parts(q: Float8Tensor) -> TransposedShard:
    """What forward saves of x^T: payload, scales and (two-level formats) the per-tensor decode scale."""
    return TransposedShard(*q.col_major(), q.global_scale_inv_t)


def _logical_shape(payload: torch.Tensor, fmt) -> tuple[int, int]:
    """(rows, cols) of the tensor a payload holds: a packed 4-bit payload holds two elements per byte."""
    rows, cols = payload.shape
    return rows, cols * 8 // fmt.bits


def route_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """A parameter's fp32 gradient: added into `param.main_grad` (any float dtype; None is returned, so
    `.grad` stays None), or returned in the parameter's dtype for autograd to accumulate."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        return grad.to(param.dtype)
    main_grad.add_(grad.view_as(main_grad))  # computed in fp32, rounded once into a bf16 buffer
    return None


def _wgrad(dy_t: Float8Tensor, x_t: Float8Tensor, weight: torch.Tensor,
           column_scale: torch.Tensor | None) -> torch.Tensor | None:
    """dW = dY^T @ x from the transposed copies (as row-major operands), accumulated into an fp32 `main_grad`
    inside the GEMM where it can be."""
    main_grad = getattr(weight, "main_grad", None)
    if (main_grad is not None and main_grad.dtype == torch.float32 and column_scale is None
            and main_grad.is_contiguous()):
        scaled_gemm(dy_t, x_t, out_dtype=torch.float32, out=main_grad, accumulate=True)
        return None
    grad = scaled_gemm(dy_t, x_t, out_dtype=torch.float32)
    if column_scale is not None:
        grad.mul_(column_scale)  # Smooth-SwiGLU: d(W/s)/dW = 1/s per column, exact for powers of two
    return route_grad(weight, grad)


def _deferred_wgrad(dy_t: Float8Tensor, x_t: Float8Tensor, weight: torch.Tensor, args: Fp8LinearArgs):
    """The wgrad B queued for the W pass: the same GEMM on the same FP8 operands, run later."""
    def run() -> torch.Tensor | None:
        x_t_full = x_t
        if args.sp_input is not None:  # this rank's x^T columns: gathered over TP now, in W
            data_t = args.sp_input.gather_cols_async(x_t.data).wait()
            x_t_full = dataclasses.replace(x_t, shape=_logical_shape(data_t, x_t.format), data=data_t)
        return _wgrad(dy_t, x_t_full, weight, args.wgrad_column_scale)
    return run


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_fp8: Float8Tensor, args: Fp8LinearArgs, *prologue_params):
        recipe, layer, prologue = args.recipe, args.layer, args.prologue
        needs_wgrad = ctx.needs_input_grad[1]  # grad mode is off inside forward; ask autograd instead
        x_quantizer = recipe.quantizer("input")
        raw, extras = x, ()
        # A high-precision fprop (a precision schedule's forward-only switch) reads x itself: no fused cast.
        fused = (_fused_prologue_input(raw, prologue_params, args, needs_wgrad)
                 if prologue is not None and not recipe.fprop_high_precision else None)
        if prologue is not None and fused is None:
            x, extras = prologue.forward(raw, *prologue_params)  # unfused: the same values, in high precision first
        x_dtype, x_shape = prologue.output_meta(raw, *prologue_params) if fused is not None else (x.dtype, x.shape)
        # The kurtosis monitor's log iterations (kurtosis.py: an extra pass over the input; a compiled graph writes the
        # layer's moments slot) and an FP4 layer's grad-noise probe steps (grad_noise.py: the input kept for the exact
        # wgrad) read the input in high precision; a fused prologue never wrote it, so it runs again, once for both.
        probes = getattr(layer, "grad_noise_probe", None) is not None and needs_wgrad and recipe.element_bits == 4
        if probes and args.sp_input is not None:
            raise NotImplementedError("the FP4 grad-noise probe under sequence parallelism (it needs the gathered "
                                      "high-precision input); --fp4-until-grad-noise runs without --sequence-parallel")
        x_high = None
        if layer.kurtosis_enabled or probes:
            x_high = prologue.forward(raw, *prologue_params)[0] if fused is not None else x
        if layer.kurtosis_enabled:
            record_input_moments(layer, x_high)
        probe_x = x_high.detach().reshape(-1, x_high.shape[-1]) if probes else None
        x_high = None  # the fused path recomputed it: not held through the GEMM

        # ---- quantize x (and keep x^T for wgrad); under SP gather this rank's FP8 shard ----
        if fused is not None and args.sp_input is not None:  # this rank's shard, cast by the fused kernel
            local, extras = fused
            pending = args.sp_input.gather_rows_async(local)
            x_t = x_quantizer.transposed_fused_shard(local, args.sp_input) if needs_wgrad else None
            x_fp8 = pending.wait()
        elif fused is not None:
            x_fp8, extras = fused
            x_t = _transposed_parts(x_fp8) if needs_wgrad else None
        elif args.sp_input is not None:
            x2d = x.reshape(-1, x.shape[-1])
            pending, local = _gather_quantized(x2d, recipe, "input", layer, args.sp_input, args.observe)
            # Only this rank's shard of x^T is kept (Megatron/TE keep the local shard too); built while
            # the gather is in flight.
            x_t = x_quantizer.transposed_sequence_shard(x2d, local, args.sp_input) if needs_wgrad else None
            x_fp8 = pending.wait()
        else:
            x2d = x.reshape(-1, x.shape[-1])
            x_fp8 = quantize_operand(x2d, recipe, "input", layer.scaling_state("input", recipe), needs_wgrad, layer,
                                     observe=args.observe)
            x_t = _transposed_parts(x_fp8) if needs_wgrad else None


        # ---- fprop GEMM; a row-parallel output is reduce-scattered to this rank's sequence shard ----
        if recipe.fprop_high_precision:  # the NVFP4 paper's late switch of the forward GEMMs only (precision_schedule.py)
            if args.sp_input is not None:
                raise NotImplementedError("a high-precision fprop under sequence parallelism would gather x in high "
                                          "precision; the forward-only precision switch runs without --sequence-parallel")
            w = weight if args.wgrad_column_scale is None else weight * args.wgrad_column_scale.to(weight.dtype)
            y = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w.to(x.dtype),
                                           bias.to(x.dtype) if bias is not None else None)
        else:
            y = scaled_gemm(x_fp8, weight_fp8, out_dtype=x_dtype, bias=bias, fast_accum=recipe.fast_accum("fprop"))
        if args.sp_output is not None:
            y = args.sp_output.reduce_scatter_rows_async(y).wait()

        deferral = getattr(layer, "wgrad_deferral", None)
        if deferral is not None and needs_wgrad and args.observe:
            deferral.expect(weight)  # a zero-bubble stage's W pass delivers this gradient (deferred_wgrad.py)
        # The leaves themselves, whose gradients go to their main_grad: a recomputed forward's saved copy of one
        # (torch.utils.checkpoint) is another object, without it (its gradient would round to the parameter's dtype
        # in .grad first).
        ctx.weight_param, ctx.bias_param = weight, bias
        ctx.args, ctx.weight_fp8 = args, weight_fp8  # the module owns the FP8 weight
        ctx.x_dtype, ctx.x_shape, ctx.x_kind = x_dtype, x_shape, (x_fp8.format, x_fp8.layout)
        ctx.probe_x = probe_x
        # A prologue's output is not saved in high precision: its backward needs only its input, params and extras.
        ctx.save_for_backward(*(x_t or (None, None, None)), *((raw, *prologue_params, *extras) if prologue else ()))
        return y.view(-1, *x_shape[1:-1], y.shape[-1])  # dim 0 changes by the TP size under sequence parallel

    @staticmethod
    def backward(ctx, grad_output):
        x_t, x_scale_t, x_global_t, *prologue_saved = ctx.saved_tensors
        weight, bias = ctx.weight_param, ctx.bias_param
        args = ctx.args
        recipe, layer = args.recipe, args.layer
        prologue_needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:]) if args.prologue is not None else ()
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0] or any(prologue_needs), ctx.needs_input_grad[1]
        deferral = getattr(layer, "wgrad_deferral", None)
        defer = needs_wgrad and deferral is not None and deferral.active and ctx.weight_param in deferral.expected
        # Under SP the saved x^T is this rank's columns: re-gather them while dY is quantized and dgrad runs
        # (deferred: in the W pass, so B holds only the local shard).
        x_t_pending = args.sp_input.gather_cols_async(x_t) if needs_wgrad and args.sp_input is not None \
            and not defer else None

        # ---- quantize dY (with dY^T for wgrad); under SP gather the output-gradient shard ----
        dy2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        if args.sp_output is not None:
            pending, local = _gather_quantized(dy2d, recipe, "grad_output", layer, args.sp_output, args.observe)
            dy_quantizer = recipe.quantizer("grad_output")
            if needs_wgrad and dy_quantizer.transposes_shard_locally:
                # Microscaling: this rank's columns of dY^T from its own high-precision rows (their token groups are
                # its own), gathered as low-precision bytes like x^T, instead of re-quantizing the gathered values.
                key = layer.next_rounding_key("grad_output_t") if dy_quantizer.stochastic else None
                data_t, scale_t, global_t = dy_quantizer.transposed_sequence_shard(dy2d, local, args.sp_output, key)
                data_t = args.sp_output.gather_cols_async(data_t).wait()
                dy_fp8 = dataclasses.replace(pending.wait(), data_t=data_t, scale_inv_t=scale_t,
                                             global_scale_inv_t=global_t)
            else:
                dy_fp8 = pending.wait()
                dy_fp8 = dy_quantizer.with_transposed_copy(dy_fp8) if needs_wgrad else dy_fp8
        else:
            dy_fp8 = quantize_operand(dy2d, recipe, "grad_output", layer.scaling_state("grad_output", recipe),
                                      needs_wgrad, layer, observe=args.observe)

        # ---- dgrad: dX = dY @ W, reduced over TP (SP: reduce-scatter, else all-reduce) in the background ----
        dgrad_pending = None
        if needs_dgrad:
            grad_input = scaled_gemm(dy_fp8, ctx.weight_fp8.t(), out_dtype=ctx.x_dtype)
            if args.sp_input is not None:
                dgrad_pending = args.sp_input.reduce_scatter_rows_async(grad_input)
            elif args.tp_input is not None:
                dgrad_pending = args.tp_input.all_reduce_async(grad_input)
            else:
                dgrad_pending = _Done(grad_input)

        # ---- wgrad: dW = dY^T @ x, while dgrad's reduction is in flight (or deferred to the W pass) ----
        grad_weight = None
        if needs_wgrad:
            x_format, x_layout = ctx.x_kind
            x_t_operand = Float8Tensor(_logical_shape(x_t, x_format), x_format, x_layout, x_t, x_scale_t,
                                       global_scale_inv=x_global_t)
        if needs_wgrad and ctx.probe_x is not None:  # (never under SP: x_t_operand is the whole x^T)
            layer.grad_noise_probe.record(dy2d, ctx.probe_x, scaled_gemm(dy_fp8.t(), x_t_operand,
                                                                         out_dtype=torch.float32),
                                          args.wgrad_column_scale)
        if defer:
            deferral.push(ctx.weight_param, _deferred_wgrad(dy_fp8.t(), x_t_operand, ctx.weight_param, args),
                          (*dy_fp8.col_major(), x_t, x_scale_t))
        elif needs_wgrad:
            if x_t_pending is not None:
                data_t = x_t_pending.wait()
                x_t_operand = dataclasses.replace(x_t_operand, shape=_logical_shape(data_t, x_format), data=data_t)
            grad_weight = _wgrad(dy_fp8.t(), x_t_operand, weight, args.wgrad_column_scale)

        grad_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = route_grad(bias, dy2d.sum(dim=0, dtype=torch.float32))
        grad_input = dgrad_pending.wait().view(ctx.x_shape) if dgrad_pending is not None else None
        if args.prologue is None:
            return grad_input, grad_weight, grad_bias, None, None
        grad_raw, *grad_params = args.prologue.backward(grad_input, prologue_needs, *prologue_saved)
        return grad_raw, grad_weight, grad_bias, None, None, *grad_params


class _BiasAdd(torch.autograd.Function):
    """y + b whose bias gradient is routed like the op's (into `bias.main_grad` when it exists)."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.bias = bias  # the leaf, with its main_grad (see _Fp8LinearFunction.forward)
        return y + bias

    @staticmethod
    def backward(ctx, grad_output):
        bias = ctx.bias
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = route_grad(bias, grad_output.reshape(-1, bias.numel()).sum(dim=0, dtype=torch.float32))
        return grad_output, grad_bias


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias, with the bias gradient routed into `bias.main_grad` when it exists (see route_grad)."""
    return _BiasAdd.apply(y, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_fp8: Float8Tensor,
               recipe: Fp8Recipe, layer: Fp8GemmModule, sp_input: SequenceParallelComm | None = None,
               sp_output: SequenceParallelComm | None = None, *, tp_input: SequenceParallelComm | None = None,
               observe: bool = True, wgrad_column_scale: torch.Tensor | None = None,
               prologue: InputPrologue | None = None) -> torch.Tensor:
    """The FP8 linear autograd op. `weight` is the leaf Parameter (its values are not read: `weight_fp8`
    is the GEMM operand); its gradient and the bias's are routed into `main_grad` when it exists.
    Tensor parallelism (communication inside the op, so it can overlap the GEMMs):
    sp_input   x is this rank's sequence shard: quantized once, all-gathered as FP8; dgrad is reduce-scattered.
    sp_output  the output partial sums are reduce-scattered to this rank's shard; in backward the output
               gradient shard is quantized once and all-gathered as FP8 for dgrad and wgrad.
    tp_input   (no SP) x is replicated over TP: dgrad is all-reduced, overlapped with wgrad.
    wgrad_column_scale  multiplies wgrad's columns (Smooth-SwiGLU's 1/s; `weight_fp8` holds W / s).
    prologue   x is the prologue's input (RMSNorm / SwiGLU, prologue.py): fused into the input's quantization
               where it can be, recomputed in backward; its parameters' gradients are returned to autograd."""
    if sp_output is not None and bias is not None:
        raise ValueError("a bias inside a reduce-scattered GEMM would be summed once per rank: add it after")
    args = Fp8LinearArgs(recipe, layer, sp_input, sp_output, tp_input, observe, wgrad_column_scale, prologue)
    params = prologue.params() if prologue is not None else ()
    if getattr(layer, "wgrad_deferral", None) is not None:  # a zero-bubble stage's: the W pass's host-side queue
        return _apply_outside_compiled_graphs(x, weight, bias, weight_fp8, args, *params)
    return _Fp8LinearFunction.apply(x, weight, bias, weight_fp8, args, *params)


def _apply_outside_compiled_graphs(*inputs):
    """The op run eagerly between graphs under --compile (an eager island: megafp8.model.compile.mark_eager_islands):
    its backward queues Python closures for the W pass (deferred_wgrad.py), which a traced backward would bake in or
    drop."""
    return _Fp8LinearFunction.apply(*inputs)
