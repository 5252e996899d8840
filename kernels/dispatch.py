"""One public function per op, each a torch custom op (megafp8::quantize, megafp8::fp8_gemm[_into]) with a
fake implementation, so torch.compile traces through them without a graph break.

Backends: Triton on CUDA tensors, the torch reference twin on CPU tensors. Override with `backend=` or
the environment variable MEGAFP8_KERNEL_BACKEND (auto | triton | reference); tests force "triton" on CPU
together with TRITON_INTERPRET=1 to run the real kernels in the interpreter. fp8_gemm also takes
backend="scaled_mm" (torch._scaled_mm), which the auto backend picks on CUDA for the scale modes in
MEGAFP8_SCALED_MM_MODES (see scaled_mm.py). The choice is made when the op runs, not when it is traced.
The GEMM's scale mode comes from the operands' layouts the caller declares (`layouts=`), not from the scale
shapes, which cannot tell a 1x128 x 1x128 GEMM with K <= 128 from a rowwise one; undeclared calls are guessed.
"""
from __future__ import annotations

import os

import torch

from .custom_op_startup import run_eagerly_until_dynamo
from .gemm_reference import fp8_gemm_reference
from .quantize_reference import quantize_reference
from .formats import ScaleLayout, scale_layout
from .scaled_mm import fp8_gemm_scaled_mm, scaled_mm_modes, scaled_mm_supports
from .scaling import (
    Fp8Quantized,
    GemmScaleMode,
    Granularity,
    check_gemm_args,
    check_quantize_args,
    empty_scales,
    granularity,
)

BACKENDS = ("auto", "triton", "reference")
GEMM_BACKENDS = (*BACKENDS, "scaled_mm")
ENV_VAR = "MEGAFP8_KERNEL_BACKEND"


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """'triton' or 'reference' for tensors on `device`."""
    choice = backend or os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        source = "backend=" if backend else ENV_VAR
        raise ValueError(f"{source}{choice!r} is not a kernel backend: choose one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the Triton backend was requested for CPU tensors: set TRITON_INTERPRET=1 before importing "
            "megafp8_kernels to run the kernels in Triton's interpreter, or use the reference backend"
        )
    return choice


def resolve_gemm_backend(mode: GemmScaleMode, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                         bias: torch.Tensor | None, accumulate: bool, backend: str | None = None) -> str:
    """'triton', 'reference' or 'scaled_mm' for one GEMM call."""
    if backend == "scaled_mm":
        reason = scaled_mm_supports(mode, a, b, out_dtype, bias, accumulate)
        if reason is not None:
            raise ValueError(f"backend='scaled_mm' cannot run this GEMM: {reason}")
        return backend
    choice = resolve_backend(a.device, backend)
    explicit = backend or os.environ.get(ENV_VAR, "auto")
    if (explicit == "auto" and choice == "triton" and mode in scaled_mm_modes()
            and scaled_mm_supports(mode, a, b, out_dtype, bias, accumulate) is None):
        return "scaled_mm"
    return choice


# ---- quantize ----------------------------------------------------------------------------------------

@torch.library.custom_op("megafp8::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, fp8_dtype: torch.dtype, granularity_: str, power_of_2_scale: bool,
                 scale: torch.Tensor | None, transpose: bool, backend: str, stats: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kwargs = dict(power_of_2_scale=power_of_2_scale, scale=scale, transpose=transpose, stats=stats)
    # Row-major outputs whatever x's strides (a compiled graph may hand over a transposed view): the fake promises
    # contiguous outputs, and the elementwise cast would otherwise follow x's layout (or alias data_t with data).
    x = x.contiguous()
    if resolve_backend(x.device, backend or None) == "triton":
        from .quantize_triton import quantize_triton  # Triton is imported only where it is used

        q = quantize_triton(x, fp8_dtype, granularity_, **kwargs)
    else:
        q = quantize_reference(x, fp8_dtype, granularity_, **kwargs)
    # Outputs the call did not ask for are empty tensors (a custom op returns tensors, not None).
    data_t, scale_inv_t = (q.data_t, q.scale_inv_t) if transpose else _no_transposed_copy(x, fp8_dtype)
    counts = q.counts if stats else x.new_empty(0, dtype=torch.int64)
    return unaliased_outputs((q.data, q.scale_inv, q.amax, data_t, scale_inv_t, counts))


def unaliased_outputs(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A custom op's outputs may not share storage: a one-row x's transposed copy (``[K, 1]`` from ``[1, K]``, already
    contiguous) is a view of its data (an MoE expert that got one token)."""
    seen, result = set(), []
    for t in outputs:
        pointer = t.untyped_storage().data_ptr() if t.numel() else None
        result.append(t.clone() if pointer in seen else t)
        seen.add(pointer)
    return tuple(result)


def _no_transposed_copy(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(0, dtype=fp8_dtype), x.new_empty(0, dtype=torch.float32)


run_eagerly_until_dynamo(_quantize_op)


@_quantize_op.register_fake
def _(x, fp8_dtype, granularity_, power_of_2_scale, scale, transpose, backend, stats=False):
    gran = granularity(granularity_)
    check_quantize_args(x, fp8_dtype, gran, scale)
    M, K = x.shape
    scale_inv, amax = empty_scales(M, K, gran, x.device), empty_scales(M, K, gran, x.device)
    data_t, scale_inv_t = ((x.new_empty((K, M), dtype=fp8_dtype), empty_scales(K, M, gran, x.device)) if transpose
                           else _no_transposed_copy(x, fp8_dtype))
    counts = x.new_empty(2 if stats else 0, dtype=torch.int64)
    return x.new_empty((M, K), dtype=fp8_dtype), scale_inv, amax, data_t, scale_inv_t, counts


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str | Granularity = Granularity.TENSORWISE,
    *,
    power_of_2_scale: bool = False,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    stats: bool = False,
    backend: str | None = None,
) -> Fp8Quantized:
    """Quantize a 2-D tensor to FP8 (see quantize_reference for the exact rules). stats=True also returns
    the cast's saturated/flushed counts (Fp8Quantized.counts), counted in the same pass."""
    gran = granularity.value if isinstance(granularity, Granularity) else granularity
    data, scale_inv, amax, data_t, scale_inv_t, counts = torch.ops.megafp8.quantize(
        x, fp8_dtype, gran, power_of_2_scale, scale, transpose, backend or "", stats)
    return Fp8Quantized(data, scale_inv, amax, data_t if transpose else None, scale_inv_t if transpose else None,
                        counts if stats else None)


# ---- GEMM --------------------------------------------------------------------------------------------

def _check_fast_accum(mode: GemmScaleMode, fast_accum: bool) -> None:
    if fast_accum and mode not in (GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE):
        raise ValueError(f"fast_accum=True is for tensorwise/rowwise GEMMs (fprop); {mode.value} promotes every 128 of K")


def _declared(layout_a: str, layout_b: str) -> tuple[str, str] | None:
    """The custom ops carry layouts as names; "" means the caller declared none."""
    return (layout_a, layout_b) if layout_a or layout_b else None


def _run_gemm(a, b, scale_a, scale_b, out_dtype, bias, out, accumulate, backend, fast_accum=False,
              layouts=None) -> torch.Tensor:
    mode = check_gemm_args(a, b, scale_a, scale_b, out_dtype, bias, out, accumulate, layouts)
    _check_fast_accum(mode, fast_accum)
    layouts = mode.operand_layouts  # the twins check the scales against the mode found here, not a new guess
    choice = resolve_gemm_backend(mode, a, b, out_dtype, bias, accumulate, backend or None)
    if choice == "scaled_mm":
        return fp8_gemm_scaled_mm(a, b, scale_a, scale_b, mode, out_dtype, out, fast_accum=fast_accum)
    kwargs = dict(out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate, layouts=layouts)
    if choice == "triton":
        from .gemm import fp8_gemm_triton

        return fp8_gemm_triton(a, b, scale_a, scale_b, **kwargs, fast_accum=fast_accum)
    return fp8_gemm_reference(a, b, scale_a, scale_b, **kwargs)  # exact fp32: fast_accum changes nothing here


@torch.library.custom_op("megafp8::fp8_gemm", mutates_args=())
def _fp8_gemm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype, bias: torch.Tensor | None, backend: str, fast_accum: bool = False,
                 layout_a: str = "", layout_b: str = "") -> torch.Tensor:
    return _run_gemm(a, b, scale_a, scale_b, out_dtype, bias, None, False, backend, fast_accum,
                     _declared(layout_a, layout_b))


run_eagerly_until_dynamo(_fp8_gemm_op)


@_fp8_gemm_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype, bias, backend, fast_accum=False, layout_a="", layout_b=""):
    mode = check_gemm_args(a, b, scale_a, scale_b, out_dtype, bias, None, False, _declared(layout_a, layout_b))
    _check_fast_accum(mode, fast_accum)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("megafp8::fp8_gemm_into", mutates_args=("out",))
def _fp8_gemm_into_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      bias: torch.Tensor | None, out: torch.Tensor, accumulate: bool, backend: str,
                      layout_a: str = "", layout_b: str = "") -> None:
    _run_gemm(a, b, scale_a, scale_b, out.dtype, bias, out, accumulate, backend, layouts=_declared(layout_a, layout_b))


run_eagerly_until_dynamo(_fp8_gemm_into_op)


@_fp8_gemm_into_op.register_fake
def _(a, b, scale_a, scale_b, bias, out, accumulate, backend, layout_a="", layout_b=""):
    check_gemm_args(a, b, scale_a, scale_b, out.dtype, bias, out, accumulate, _declared(layout_a, layout_b))


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: str | None = None,
    fast_accum: bool = False,
    layouts: tuple[str | Granularity | ScaleLayout, str | Granularity | ScaleLayout] | None = None,
) -> torch.Tensor:
    """C = (A * scale_a) @ (B * scale_b).T [+ bias] [+ C] with fp32 accumulation (see gemm_reference).
    `layouts` declares the (A, B) scale layouts (ScaleLayouts or Granularity values), which pick the kernel's
    scale mode; without it the mode is guessed from the scale shapes (scaling.guess_gemm_mode).
    `fast_accum=True` (tensorwise/rowwise, no `out`; meant for fprop as TransformerEngine does) lets the
    tensor core accumulate over all of K on CUDA (Triton: one wgmma group in flight); the CPU twin is exact."""
    if backend is not None and backend not in GEMM_BACKENDS:
        raise ValueError(f"backend={backend!r} is not a GEMM backend: choose one of {', '.join(GEMM_BACKENDS)}")
    layout_a, layout_b = (scale_layout(layouts[0]).name, scale_layout(layouts[1]).name) if layouts else ("", "")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs `out`, the buffer to accumulate into")
        return torch.ops.megafp8.fp8_gemm(a, b, scale_a, scale_b, out_dtype, bias, backend or "", fast_accum,
                                          layout_a, layout_b)
    if fast_accum:
        raise ValueError("fast_accum=True is for fprop GEMMs returning a new tensor; `out`/accumulate keep fp32 promotion")
    if out.dtype != out_dtype:
        raise ValueError(f"out must be a {out_dtype} tensor, got {out.dtype}")
    torch.ops.megafp8.fp8_gemm_into(a, b, scale_a, scale_b, bias, out, accumulate, backend or "", layout_a, layout_b)
    return out

