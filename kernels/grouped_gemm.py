"""Grouped FP8 GEMMs, one call for every local expert of an MoE layer: by rows (fprop, dgrad) and by columns (wgrad).

``grouped_fp8_gemm`` runs one FP8 GEMM per group of rows, ``grouped_fp8_wgrad`` one per group of columns (the experts'
wgrad, grouped along the tokens). Both are torch custom ops (megafp8::grouped_fp8_gemm, megafp8::grouped_fp8_wgrad)
like fp8_gemm: Triton on CUDA (grouped_gemm_triton.py), the twins on CPU (grouped_gemm_reference.py), the same backend
choice (dispatch.resolve_backend)."""
from __future__ import annotations

import torch

from .custom_op_startup import run_eagerly_until_dynamo
from .dispatch import resolve_backend
from .formats import ScaleLayout, scale_layout
from .grouped_gemm_reference import grouped_fp8_gemm_reference, grouped_fp8_wgrad_reference
from .scaling import BLOCK, GEMM_OUT_DTYPES, GemmScaleMode, check_gemm_args, check_gemm_dtypes

GROUPED_MODES = (GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE)
GROUPED_WGRAD_MODES = (GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE_1X128)


def check_grouped_gemm_args(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                            group_ends: torch.Tensor, layouts: tuple, out_dtype: torch.dtype,
                            fast_accum: bool) -> GemmScaleMode:
    """The mode of a valid call, else one ValueError saying what to pass (no host read of the ends)."""
    if b.dim() != 3:
        raise ValueError(f"grouped_fp8_gemm wants B (groups, N, K), got shape {tuple(b.shape)}")
    if group_ends.dim() != 1 or group_ends.numel() != b.shape[0] or group_ends.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_ends must be an int32/int64 vector of one cumulative row end per group "
                         f"({b.shape[0]}), got {group_ends.dtype} of shape {tuple(group_ends.shape)}")
    if out_dtype not in GEMM_OUT_DTYPES:
        raise ValueError(f"unsupported GEMM output dtype {out_dtype}: use float32, bfloat16 or float16")
    mode = GemmScaleMode.declared(*layouts)
    if mode not in GROUPED_MODES:
        raise ValueError(f"grouped_fp8_gemm runs rowwise (PER_ROW x PER_ROW; tensorwise scales expanded to rows) and "
                         f"blockwise (BLOCK_1X128 x BLOCK_128X128) GEMMs, not {mode.value}")
    if fast_accum and mode is not GemmScaleMode.ROWWISE:
        raise ValueError("fast_accum=True is for rowwise GEMMs (fprop); blockwise promotes every 128 of K")
    if scale_b.dim() != 3 or scale_b.shape[0] != b.shape[0]:
        raise ValueError(f"scale_b must hold one scale tensor per group, (groups, ...), got {tuple(scale_b.shape)}")
    # One group's operands are a plain FP8 GEMM's: the same checks (dtypes, K, scale shapes).
    check_gemm_args(a, b[0], scale_a, scale_b[0], out_dtype, None, None, False, mode.operand_layouts)
    return mode


@torch.library.custom_op("megafp8::grouped_fp8_gemm", mutates_args=())
def _grouped_fp8_gemm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                         group_ends: torch.Tensor, layout_a: str, layout_b: str, out_dtype: torch.dtype,
                         fast_accum: bool, backend: str) -> torch.Tensor:
    mode = GemmScaleMode.declared(layout_a, layout_b)
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[1]), dtype=out_dtype)
    if resolve_backend(a.device, backend or None) == "triton":
        from .grouped_gemm_triton import grouped_fp8_gemm_triton  # Triton is imported only where it is used

        return grouped_fp8_gemm_triton(a, b, scale_a, scale_b, group_ends, mode, out_dtype, fast_accum)
    return grouped_fp8_gemm_reference(a, b, scale_a, scale_b, group_ends, mode, out_dtype)  # exact: no fast_accum


run_eagerly_until_dynamo(_grouped_fp8_gemm_op)


@_grouped_fp8_gemm_op.register_fake
def _(a, b, scale_a, scale_b, group_ends, layout_a, layout_b, out_dtype, fast_accum, backend):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def grouped_fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     group_ends: torch.Tensor, *, layouts: tuple[str | ScaleLayout, str | ScaleLayout],
                     out_dtype: torch.dtype = torch.float32, fast_accum: bool = False,
                     backend: str | None = None) -> torch.Tensor:
    """C (M, N), group g's rows ``[ends[g-1], ends[g])`` of A (M, K) times B[g] (N, K) transposed, accumulated in fp32.

    group_ends: (G,) cumulative row ends on A's device (nondecreasing, the last = M; an empty group repeats its
                predecessor's end); the Triton kernel never reads them on the host.
    layouts:    the declared (A, B) scale layouts: PER_ROW x PER_ROW (scale_a (M, 1), scale_b (G, N, 1)) or
                BLOCK_1X128 x BLOCK_128X128 (scale_a (M, K/128), scale_b (G, N/128, K/128)).
    fast_accum: rowwise only (fprop): the tensor core accumulates over all of K on CUDA; the CPU twin is exact."""
    mode = check_grouped_gemm_args(a, b, scale_a, scale_b, group_ends, layouts, out_dtype, fast_accum)
    layout_a, layout_b = (scale_layout(layout).name for layout in mode.operand_layouts)
    return torch.ops.megafp8.grouped_fp8_gemm(a, b, scale_a, scale_b, group_ends, layout_a, layout_b, out_dtype,
                                              fast_accum, backend or "")


def check_grouped_wgrad_args(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                             group_sizes: torch.Tensor, layouts: tuple) -> GemmScaleMode:
    """The mode of a valid grouped wgrad call, else one ValueError saying what to pass (no host read of the sizes)."""
    if group_sizes.dim() != 1 or group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_sizes must be an int32/int64 vector of each group's columns, got {group_sizes.dtype} "
                         f"of shape {tuple(group_sizes.shape)}")
    mode = GemmScaleMode.declared(*layouts)
    if mode not in GROUPED_WGRAD_MODES:
        raise ValueError(f"grouped_fp8_wgrad runs rowwise (PER_ROW x PER_ROW; tensorwise scales expanded to rows) and "
                         f"blockwise 1x128 (BLOCK_1X128 x BLOCK_1X128) GEMMs, not {mode.value}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] % BLOCK:
        raise ValueError(f"grouped_fp8_wgrad wants A (M, K) and B (N, K) with the same K, each group's columns padded "
                         f"to a multiple of {BLOCK}: got {tuple(a.shape)} and {tuple(b.shape)}")
    groups = group_sizes.numel()
    if mode is GemmScaleMode.ROWWISE:
        want = ((groups, a.shape[0], 1), (groups, b.shape[0], 1))
    else:
        want = ((a.shape[0], a.shape[1] // BLOCK), (b.shape[0], b.shape[1] // BLOCK))
    for name, scale, shape in (("scale_a", scale_a, want[0]), ("scale_b", scale_b, want[1])):
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(f"{name} of a {mode.value} grouped wgrad must be a float32 {shape} tensor, got "
                             f"{scale.dtype} {tuple(scale.shape)}")
    check_gemm_dtypes(a, b)
    return mode


@torch.library.custom_op("megafp8::grouped_fp8_wgrad", mutates_args=())
def _grouped_fp8_wgrad_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          group_sizes: torch.Tensor, layout_a: str, layout_b: str, backend: str) -> torch.Tensor:
    mode = GemmScaleMode.declared(layout_a, layout_b)
    if resolve_backend(a.device, backend or None) == "triton":
        from .grouped_gemm_triton import grouped_fp8_wgrad_triton

        return grouped_fp8_wgrad_triton(a, b, scale_a, scale_b, group_sizes, mode)
    return grouped_fp8_wgrad_reference(a, b, scale_a, scale_b, group_sizes, mode)


run_eagerly_until_dynamo(_grouped_fp8_wgrad_op)


@_grouped_fp8_wgrad_op.register_fake
def _(a, b, scale_a, scale_b, group_sizes, layout_a, layout_b, backend):
    return a.new_empty((group_sizes.numel(), a.shape[0], b.shape[0]), dtype=torch.float32)


def grouped_fp8_wgrad(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      group_sizes: torch.Tensor, *, layouts: tuple[str | ScaleLayout, str | ScaleLayout],
                      backend: str | None = None) -> torch.Tensor:
    """C (G, M, N) fp32: C[g] = group g's columns of A (M, K) times those of B (N, K), transposed (the experts' wgrad
    dW_e = dY_e^T X_e from their transposed copies laid side by side).

    group_sizes: (G,) each group's columns on A's device; group g starts where the groups before it end, each padded
                 with zero columns to a multiple of 128 (K is the sum of the padded sizes).
    layouts:     PER_ROW x PER_ROW (scale_a (G, M, 1), scale_b (G, N, 1): each group's own) or BLOCK_1X128 x BLOCK_1X128
                 (scale_a (M, K/128), scale_b (N, K/128): the padded columns' 128-column groups)."""
    mode = check_grouped_wgrad_args(a, b, scale_a, scale_b, group_sizes, layouts)
    layout_a, layout_b = (scale_layout(layout).name for layout in mode.operand_layouts)
    return torch.ops.megafp8.grouped_fp8_wgrad(a, b, scale_a, scale_b, group_sizes, layout_a, layout_b, backend or "")


def columns_side_by_side(payloads: list[torch.Tensor]) -> torch.Tensor:
    """The groups' (rows, size_g) FP8 payloads laid side by side as grouped_fp8_wgrad reads them: each padded with zero
    columns to a multiple of 128 (one copy of the bytes)."""
    padded = [-(-p.shape[1] // BLOCK) * BLOCK for p in payloads]
    out = torch.zeros((payloads[0].shape[0], sum(padded)), dtype=torch.uint8, device=payloads[0].device)
    start = 0
    for payload, width in zip(payloads, padded):
        out[:, start:start + payload.shape[1]] = payload.view(torch.uint8)
        start += width
    return out.view(payloads[0].dtype)
