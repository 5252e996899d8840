"""FP8 scaling granularities (the user-facing names of formats.py's scale layouts), the quantizer's result, and the
argument checks of quantize and the GEMM, whose scale mode the caller declares."""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from .formats import (  # noqa: F401 - BLOCK, E4M3, E5M2 are re-exported: their importers predate formats.py
    BLOCK,
    BLOCK_1X128,
    BLOCK_128X128,
    E4M3,
    E5M2,
    ELEMENT_FORMATS,
    PER_ROW,
    PER_TENSOR,
    ElementFormat,
    ScaleLayout,
    element_format,
    scale_layout,
)

FLOAT32_MAX = torch.finfo(torch.float32).max
Fp8Format = ElementFormat  # the old names, kept for callers
fp8_format = element_format


class Granularity(str, enum.Enum):
    """How many elements share one scale: the user-facing name of a ScaleLayout (Granularity.layout)."""

    TENSORWISE = "tensorwise"  # one scale
    ROWWISE = "rowwise"  # one scale per row
    BLOCK_1X128 = "block_1x128"  # one scale per row per 128 columns (activations, gradients)
    BLOCK_128X128 = "block_128x128"  # one scale per 128x128 tile (weights)

    @property
    def layout(self) -> ScaleLayout:
        return scale_layout(self.value)


def layout_granularity(layout: ScaleLayout) -> Granularity | ScaleLayout:
    """A layout by its Granularity name where it has one (today's four, which the kernels take), else itself."""
    try:
        return Granularity(layout.name)
    except ValueError:
        return layout


def granularity(value: str | Granularity) -> Granularity:
    try:
        return Granularity(value)
    except ValueError:
        choices = ", ".join(g.value for g in Granularity)
        raise ValueError(f"unknown scaling granularity {value!r}: choose one of {choices}") from None


def scale_shape(rows: int, cols: int, gran: Granularity) -> tuple[int, ...]:
    """Shape of the scale tensor for a (rows, cols) operand; cols is the GEMM's K dimension."""
    return scale_layout(gran).scale_shape(rows, cols)


def scale_is_k_block_major(gran: Granularity) -> bool:
    """1x128 scales are stored K-block-major: logical shape (rows, K/128), memory (K/128, rows).

    A GEMM's K step then loads one contiguous vector of scales for its rows instead of one strided
    element per row (DeepGEMM and torch._scaled_mm's blockwise path want this "column-major" layout
    too). Indexing is unchanged: `scale_inv[m, k]` is still row m's k-th group; only strides differ.
    """
    return scale_layout(gran).k_block_major


def empty_scales(rows: int, cols: int, gran: Granularity, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised fp32 scale tensor for a (rows, cols) operand, in the layout every backend returns."""
    shape = scale_shape(rows, cols, gran)
    if scale_is_k_block_major(gran):
        return torch.empty(shape[::-1], device=device, dtype=torch.float32).t()
    return torch.empty(shape, device=device, dtype=torch.float32)


def to_scale_layout(scales: torch.Tensor, gran: Granularity) -> torch.Tensor:
    """The same scale values in the canonical layout (see scale_is_k_block_major)."""
    if scale_is_k_block_major(gran):
        # Not scales.t().contiguous().t(): that keeps odd strides on size-1 dims, and every backend
        # must return identical strides (custom-op fake tensors and the tests compare them).
        rows, groups = scales.shape
        return torch.empty((groups, rows), device=scales.device, dtype=scales.dtype).t().copy_(scales)
    return scales.contiguous()


class Fp8Quantized(NamedTuple):
    """Result of a quantization. Dequantize as `data.float() * scale_inv` (broadcast per group).

    data:        (M, K) FP8, row-major.
    scale_inv:   fp32 dequantization scale(s), shape `scale_shape(M, K, granularity)`; 1x128 scales are
                 K-block-major in memory (see scale_is_k_block_major), the others contiguous.
    amax:        fp32 absolute max of the input per scaling group (same shape as scale_inv); with a
                 given scale (delayed scaling) it is the tensor's amax, for the next scale update.
    data_t:      (K, M) FP8 copy of x.T quantized with its own groups along M (None unless transpose=True).
                 Hopper FP8 GEMMs want both operands K-major, so dgrad/wgrad need this copy.
    scale_inv_t: its scales, `scale_shape(K, M, granularity)`; for tensorwise and 128x128 the same
                 numbers as scale_inv (transposed for tiles).
    counts:      int64 [2] (None unless stats=True): of the row-major cast, how many elements saturated
                 (|x * scale| > saturation_threshold) and how many were flushed (x != 0 quantized to +-0);
                 counted by the cast itself, so FP8 telemetry needs no second pass over the tensor.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    data_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def check_quantize_args(
    x: torch.Tensor, fp8_dtype: torch.dtype, gran: Granularity, scale: torch.Tensor | None
) -> Fp8Format:
    """Validate user-visible arguments once, with messages that say what to pass instead."""
    fmt = fp8_format(fp8_dtype)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D (rows, K) tensor, got shape {tuple(x.shape)}; flatten leading dims first")
    if x.numel() == 0:
        raise ValueError(f"quantize got an empty tensor of shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point or x.dtype in ELEMENT_FORMATS:
        raise ValueError(f"quantize expects a float32/bfloat16/float16 input, got {x.dtype}")
    if scale is not None:
        if gran is not Granularity.TENSORWISE:
            raise ValueError(f"a given scale (delayed scaling) is only supported with tensorwise granularity, not {gran.value}")
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"the given scale must be a one-element float32 tensor, got {scale.dtype} of shape {tuple(scale.shape)}")
    return fmt


class GemmScaleMode(str, enum.Enum):
    """The scale layouts an FP8 GEMM accepts, as (A layout, B layout). The caller declares them (fp8_gemm's
    `layouts`); a call that does not is matched against the scale shapes, which cannot tell every pair apart."""

    TENSORWISE = "tensorwise"  # one scale each
    ROWWISE = "rowwise"  # scale_a (M, 1), scale_b (N, 1): applied in the epilogue
    BLOCKWISE = "blockwise"  # A 1x128, B 128x128 (fprop, dgrad): applied per 128-wide K step
    BLOCKWISE_1X128 = "blockwise_1x128"  # A 1x128, B 1x128 (wgrad)

    @property
    def operand_layouts(self) -> tuple[ScaleLayout, ScaleLayout]:
        return _MODE_LAYOUTS[self]

    @property
    def operand_granularities(self) -> tuple[Granularity, Granularity]:
        return tuple(Granularity(layout.name) for layout in self.operand_layouts)

    @classmethod
    def declared(cls, layout_a: str | ScaleLayout, layout_b: str | ScaleLayout) -> GemmScaleMode:
        """The mode of a GEMM whose operands are declared with these layouts (or Granularity names)."""
        pair = (scale_layout(layout_a), scale_layout(layout_b))
        for mode, layouts in _MODE_LAYOUTS.items():
            if layouts == pair:
                return mode
        supported = "; ".join(f"{a.name} x {b.name}" for a, b in _MODE_LAYOUTS.values())
        raise ValueError(f"no FP8 GEMM for scale layouts {pair[0].name} x {pair[1].name}: supported are {supported}")


_MODE_LAYOUTS = {
    GemmScaleMode.TENSORWISE: (PER_TENSOR, PER_TENSOR),
    GemmScaleMode.ROWWISE: (PER_ROW, PER_ROW),
    GemmScaleMode.BLOCKWISE: (BLOCK_1X128, BLOCK_128X128),
    GemmScaleMode.BLOCKWISE_1X128: (BLOCK_1X128, BLOCK_1X128),
}


def _scale_fits(scale: torch.Tensor, want: tuple[int, ...]) -> bool:
    # Scales of one element count as tensorwise whatever their shape ((), (1,), (1, 1)).
    return scale.numel() == 1 if not want else tuple(scale.shape) == want


def guess_gemm_mode(M: int, N: int, K: int, scale_a: torch.Tensor, scale_b: torch.Tensor) -> GemmScaleMode | None:
    """The first mode whose scale shapes fit, for callers that do not declare their layouts. Ambiguous where
    shapes coincide: a 1x128 x 1x128 GEMM with K <= 128 has (M, 1) x (N, 1) scales and is taken for rowwise."""
    for mode, (layout_a, layout_b) in _MODE_LAYOUTS.items():
        if _scale_fits(scale_a, layout_a.scale_shape(M, K)) and _scale_fits(scale_b, layout_b.scale_shape(N, K)):
            return mode
    return None


_GEMM_DTYPES = {
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e4m3fn),  # dgrad: E5M2 gradient x E4M3 weight
    (torch.float8_e4m3fn, torch.float8_e5m2),
}
GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gemm_dtypes(a: torch.Tensor, b: torch.Tensor) -> None:
    """The FP8 operand pairs a GEMM takes, else one ValueError naming them."""
    if (a.dtype, b.dtype) not in _GEMM_DTYPES:
        raise ValueError(
            f"unsupported FP8 GEMM operand dtypes {a.dtype} x {b.dtype}: supported are E4M3 x E4M3, "
            "E5M2 x E4M3 and E4M3 x E5M2 (E5M2 x E5M2 has too few mantissa bits to be useful)"
        )


def check_gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    accumulate: bool,
    layouts: tuple[str | ScaleLayout, str | ScaleLayout] | None = None,
) -> GemmScaleMode:
    """Validate an FP8 GEMM call C = (A * scale_a) @ (B * scale_b).T and return its scale mode: the one the
    declared (A, B) `layouts` (ScaleLayouts or Granularity names) name, else the guess from the scale shapes."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm wants A (M, K) and B (N, K) with the same K, got {tuple(a.shape)} and {tuple(b.shape)}")
    check_gemm_dtypes(a, b)
    if out_dtype not in GEMM_OUT_DTYPES:
        raise ValueError(f"unsupported GEMM output dtype {out_dtype}: use float32, bfloat16 or float16")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"GEMM scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    (M, K), N = a.shape, b.shape[0]
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs `out`, the buffer to accumulate into")
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype):
        raise ValueError(f"out must be a ({M}, {N}) {out_dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if layouts is None:
        mode = guess_gemm_mode(M, N, K, scale_a, scale_b)
        if mode is not None:
            return mode
        raise ValueError(
            f"unsupported scale shapes {tuple(scale_a.shape)} x {tuple(scale_b.shape)} for A {tuple(a.shape)}, "
            f"B {tuple(b.shape)}: supported are tensorwise (1 x 1), rowwise ((M, 1) x (N, 1)), blockwise "
            "((M, K/128) x (N/128, K/128)) and blockwise 1x128 ((M, K/128) x (N, K/128))"
        )
    mode = GemmScaleMode.declared(*layouts)
    layout_a, layout_b = mode.operand_layouts
    for name, scale, layout, rows in (("scale_a", scale_a, layout_a, M), ("scale_b", scale_b, layout_b, N)):
        if not _scale_fits(scale, layout.scale_shape(rows, K)):
            raise ValueError(f"{name} of shape {tuple(scale.shape)} is not a {layout.name} scale of a ({rows}, {K}) "
                             f"operand: expected {layout.scale_shape(rows, K) or 'one element'}")
    return mode
