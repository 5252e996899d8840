"""Element formats and scale layouts: what a quantized operand is, declared as data, so quantizers, GEMMs and wire
paths read it instead of guessing from dtypes and tensor shapes."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

WHOLE = 0  # a block edge that spans the whole dimension (a tensorwise scale spans both, a rowwise one the columns)


@dataclass(frozen=True)
class ElementFormat:
    """One low-precision element encoding: what the storage, rounding and saturation code need to know.

    The first four fields keep Fp8Format's positional order (Fp8Format is this class's old name).
    """

    dtype: torch.dtype  # storage dtype (a packed format, e.g. FP4, stores two elements per uint8)
    max: float  # largest finite value; casts saturate here
    mantissa_bits: int
    min_normal_exponent: int  # below it values are subnormal (quantum 2**(emin - mantissa_bits))
    bits: int = 8  # bits per element: the wire and buffer size is bits * numel / 8, not numel
    name: str = ""

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


E4M3 = ElementFormat(torch.float8_e4m3fn, 448.0, 3, -6, bits=8, name="e4m3")
E5M2 = ElementFormat(torch.float8_e5m2, 57344.0, 2, -14, bits=8, name="e5m2")
ELEMENT_FORMATS = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}
# OCP E2M1 (FP4): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf/NaN, stored two codes per uint8 (the even element in the low
# nibble). Not in ELEMENT_FORMATS: its storage dtype (uint8) does not name it.
E2M1 = ElementFormat(torch.uint8, 6.0, 1, 0, bits=4, name="e2m1")


def element_format(dtype: torch.dtype) -> ElementFormat:
    """The ElementFormat stored as `dtype`."""
    if dtype not in ELEMENT_FORMATS:
        raise ValueError(f"unsupported FP8 dtype {dtype}: use torch.float8_e4m3fn (E4M3) or torch.float8_e5m2 (E5M2)")
    return ELEMENT_FORMATS[dtype]


class ScaleFormat(str, enum.Enum):
    """How a scale is stored: fp32 (the FP8 recipes), E8M0 biased exponents in uint8 (MXFP8/MXFP4) or E4M3 (NVFP4,
    under a per-tensor fp32 scale)."""

    FP32 = "fp32"
    E8M0 = "e8m0"
    E4M3 = "e4m3"


@dataclass(frozen=True)
class ScaleLayout:
    """Which elements share one scale and how the scales are stored. Scales run along the K-major (last) dim.

    block:          (rows, cols) of elements per scale; WHOLE spans the dimension.
    scale_format:   the scales' storage format.
    two_level:      a per-tensor fp32 scale on top of the block scales (NVFP4).
    k_block_major:  scales of logical shape (rows, K groups) lie (K groups, rows) in memory, so a GEMM's K step
                    loads one contiguous vector for its rows (DeepGEMM's and torch._scaled_mm's blockwise layout).
    """

    name: str
    block: tuple[int, int]
    scale_format: ScaleFormat = ScaleFormat.FP32
    two_level: bool = False
    k_block_major: bool = False

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of the scale tensor of a (rows, cols) operand; cols is the GEMM's K dimension."""
        if self.block == (WHOLE, WHOLE):
            return ()
        return (_groups(rows, self.block[0]), _groups(cols, self.block[1]))

    @property
    def transpose_is_relayout(self) -> bool:
        """Whether the transposed copy has the same groups (square blocks, or one scale): its bytes are moved.
        Otherwise (rows, 1x128) the transposed copy groups along the other axis and is re-quantized."""
        return self.block[0] == self.block[1]


def _groups(extent: int, edge: int) -> int:
    # -(-n // edge) is ceil(n / edge) in integers, which also holds for symbolic sizes under torch.compile.
    return 1 if edge == WHOLE else -(-extent // edge)


BLOCK = 128  # DeepSeek-V3 tile edge: 1x128 groups for activations/gradients, 128x128 for weights
# Today's four layouts; their names are the user-facing Granularity values.
PER_TENSOR = ScaleLayout("tensorwise", (WHOLE, WHOLE))
PER_ROW = ScaleLayout("rowwise", (1, WHOLE))
BLOCK_1X128 = ScaleLayout("block_1x128", (1, BLOCK), k_block_major=True)
BLOCK_128X128 = ScaleLayout("block_128x128", (BLOCK, BLOCK))
# Microscaling (OCP MX v1.0 and NVIDIA's NVFP4): one E8M0 scale per 1x32 along K; one E4M3 scale per 1x16 (activations,
# gradients) or 16x16 (weights: fprop and dgrad then read the same quantized values) under one fp32 scale per tensor.
MX_BLOCK, NVFP4_BLOCK = 32, 16
MX_1X32 = ScaleLayout("mx_1x32", (1, MX_BLOCK), ScaleFormat.E8M0)
NVFP4_1X16 = ScaleLayout("nvfp4_1x16", (1, NVFP4_BLOCK), ScaleFormat.E4M3, two_level=True)
NVFP4_16X16 = ScaleLayout("nvfp4_16x16", (NVFP4_BLOCK, NVFP4_BLOCK), ScaleFormat.E4M3, two_level=True)
SCALE_LAYOUTS = {layout.name: layout for layout in (PER_TENSOR, PER_ROW, BLOCK_1X128, BLOCK_128X128, MX_1X32,
                                                     NVFP4_1X16, NVFP4_16X16)}


def scale_layout(value: str | ScaleLayout) -> ScaleLayout:
    """The ScaleLayout named `value` (a layout name or a Granularity, whose value is the name)."""
    if isinstance(value, ScaleLayout):
        return value
    name = getattr(value, "value", value)  # a Granularity (str enum): its value, since enum hashes differ from str
    if name not in SCALE_LAYOUTS:
        raise ValueError(f"unknown scale layout {name!r}: choose one of {', '.join(SCALE_LAYOUTS)}")
    return SCALE_LAYOUTS[name]
