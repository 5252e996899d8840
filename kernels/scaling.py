"""FP8 formats, scaling granularities and the scale-shape contract shared by the Triton kernels and their twins."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

BLOCK = 128  # DeepSeek-V3 tile edge: 1x128 groups for activations/gradients, 128x128 for weights
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Fp8Format:
    """What the rounding code needs to know about one FP8 encoding."""

    dtype: torch.dtype
    max: float  # largest finite value; casts saturate here
    mantissa_bits: int
    min_normal_exponent: int  # below it values are subnormal (quantum 2**(emin - mantissa_bits))

    @property
    def saturation_threshold(self) -> float:
        """The scaled magnitude above which a value is clipped rather than rounded: FP8_MAX plus half an ulp
        at FP8_MAX (E4M3: 464, E5M2: 61440). Anything up to it rounds to a representable value honestly."""
        top_exponent = math.frexp(self.max)[1] - 1
        return self.max + 0.5 * 2.0 ** (top_exponent - self.mantissa_bits)

    @property
    def flush_threshold(self) -> float:
        """Half the smallest subnormal: a scaled magnitude up to it rounds (to nearest even) to +-0."""
        return 0.5 * 2.0 ** (self.min_normal_exponent - self.mantissa_bits)


E4M3 = Fp8Format(torch.float8_e4m3fn, 448.0, 3, -6)
E5M2 = Fp8Format(torch.float8_e5m2, 57344.0, 2, -14)
_FORMATS = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    if dtype not in _FORMATS:
        raise ValueError(f"unsupported FP8 dtype {dtype}: use torch.float8_e4m3fn (E4M3) or torch.float8_e5m2 (E5M2)")
    return _FORMATS[dtype]


class Granularity(str, enum.Enum):
    """How many elements share one scale. Scales always run along the K-major (last) dimension."""

    TENSORWISE = "tensorwise"  # one scale
    ROWWISE = "rowwise"  # one scale per row
    BLOCK_1X128 = "block_1x128"  # one scale per row per 128 columns (activations, gradients)
    BLOCK_128X128 = "block_128x128"  # one scale per 128x128 tile (weights)


def granularity(value: str | Granularity) -> Granularity:
    try:
        return Granularity(value)
    except ValueError:
        choices = ", ".join(g.value for g in Granularity)
        raise ValueError(f"unknown scaling granularity {value!r}: choose one of {choices}") from None


def scale_shape(rows: int, cols: int, gran: Granularity) -> tuple[int, ...]:
    """Shape of the scale tensor for a (rows, cols) operand; cols is the GEMM's K dimension."""
    if gran is Granularity.TENSORWISE:
        return ()
    if gran is Granularity.ROWWISE:
        return (rows, 1)
    # -(-n // BLOCK) is ceil(n / BLOCK) in integers, which also holds for symbolic sizes under torch.compile.
    if gran is Granularity.BLOCK_1X128:
        return (rows, -(-cols // BLOCK))
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def scale_is_k_block_major(gran: Granularity) -> bool:
    """1x128 scales are stored K-block-major: logical shape (rows, K/128), memory (K/128, rows).

    A GEMM's K step then loads one contiguous vector of scales for its rows instead of one strided
    element per row (DeepGEMM and torch._scaled_mm's blockwise path want this "column-major" layout
    too). Indexing is unchanged: `scale_inv[m, k]` is still row m's k-th group; only strides differ.
    """
    return gran is Granularity.BLOCK_1X128


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
    if not x.dtype.is_floating_point or x.dtype in _FORMATS:
        raise ValueError(f"quantize expects a float32/bfloat16/float16 input, got {x.dtype}")
    if scale is not None:
        if gran is not Granularity.TENSORWISE:
            raise ValueError(f"a given scale (delayed scaling) is only supported with tensorwise granularity, not {gran.value}")
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"the given scale must be a one-element float32 tensor, got {scale.dtype} of shape {tuple(scale.shape)}")
    return fmt


class GemmScaleMode(str, enum.Enum):
    """The scale layouts an FP8 GEMM accepts, as (A groups, B groups). Inferred from the scale shapes."""

    TENSORWISE = "tensorwise"  # one scale each
    ROWWISE = "rowwise"  # scale_a (M, 1), scale_b (N, 1): applied in the epilogue
    BLOCKWISE = "blockwise"  # A 1x128, B 128x128 (fprop, dgrad): applied per 128-wide K step
    BLOCKWISE_1X128 = "blockwise_1x128"  # A 1x128, B 1x128 (wgrad)

    @property
    def operand_granularities(self) -> tuple[Granularity, Granularity]:
        return {
            GemmScaleMode.TENSORWISE: (Granularity.TENSORWISE, Granularity.TENSORWISE),
            GemmScaleMode.ROWWISE: (Granularity.ROWWISE, Granularity.ROWWISE),
            GemmScaleMode.BLOCKWISE: (Granularity.BLOCK_1X128, Granularity.BLOCK_128X128),
            GemmScaleMode.BLOCKWISE_1X128: (Granularity.BLOCK_1X128, Granularity.BLOCK_1X128),
        }[self]


_GEMM_DTYPES = {
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e4m3fn),  # dgrad: E5M2 gradient x E4M3 weight
    (torch.float8_e4m3fn, torch.float8_e5m2),
}
GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    accumulate: bool,
) -> GemmScaleMode:
    """Validate an FP8 GEMM call C = (A * scale_a) @ (B * scale_b).T and return its scale mode."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm wants A (M, K) and B (N, K) with the same K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if (a.dtype, b.dtype) not in _GEMM_DTYPES:
        raise ValueError(
            f"unsupported FP8 GEMM operand dtypes {a.dtype} x {b.dtype}: supported are E4M3 x E4M3, "
            "E5M2 x E4M3 and E4M3 x E5M2 (E5M2 x E5M2 has too few mantissa bits to be useful)"
        )
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
    for mode in GemmScaleMode:
        gran_a, gran_b = mode.operand_granularities
        want_a, want_b = scale_shape(M, K, gran_a), scale_shape(N, K, gran_b)
        # Scales of one element count as tensorwise whatever their shape ((), (1,), (1, 1)).
        fits_a = scale_a.numel() == 1 if not want_a else tuple(scale_a.shape) == want_a
        fits_b = scale_b.numel() == 1 if not want_b else tuple(scale_b.shape) == want_b
        if fits_a and fits_b:
            return mode
    raise ValueError(
        f"unsupported scale shapes {tuple(scale_a.shape)} x {tuple(scale_b.shape)} for A {tuple(a.shape)}, "
        f"B {tuple(b.shape)}: supported are tensorwise (1 x 1), rowwise ((M, 1) x (N, 1)), blockwise "
        "((M, K/128) x (N/128, K/128)) and blockwise 1x128 ((M, K/128) x (N, K/128))"
    )
