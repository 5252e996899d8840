"""QuantizedTensor: a low-precision 2-D operand declared by its element format and scale layout, with its true byte
size and its parts as bytes for the wire (FP8, MXFP8, MXFP4, NVFP4)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .formats import ElementFormat, ScaleFormat, ScaleLayout, element_format, scale_layout
from .gemm_reference import dequantize
from .microscaling_reference import block_scale_values, dequantize_microscaled, pack_e2m1, unpack_e2m1
from .scaling import Fp8Quantized, Granularity, layout_granularity


@dataclass
class QuantizedTensor:
    """A (rows, cols) tensor in a low-precision format; cols is the K dimension of the row-major copy.

    format / layout:      what an element is (ElementFormat) and which elements share a scale (ScaleLayout); a
                          storage dtype or a Granularity is accepted and normalised, so `QuantizedTensor(shape,
                          torch.float8_e4m3fn, Granularity.ROWWISE, ...)` reads as it always did.
    data / scale_inv:     row-major payload and dequantization scales (groups along cols)
    data_t / scale_inv_t: the transposed (cols, rows) copy, groups along rows; present when a GEMM needs the
                          tensor K-major the other way round (dgrad, wgrad). Either copy may be absent.
    global_scale_inv(_t): the per-tensor decode scale on top of the block scales of each copy (two-level layouts:
                          NVFP4, whose Hadamard-transformed transposed copy has its own).
    Microscaled layouts (scale_format E8M0 / E4M3) store their scales as bytes: uint8 biased exponents, float8_e4m3fn.
    """

    shape: tuple[int, int]
    format: ElementFormat
    layout: ScaleLayout
    data: torch.Tensor | None = None
    scale_inv: torch.Tensor | None = None
    data_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None
    global_scale_inv: torch.Tensor | None = None
    global_scale_inv_t: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        if not isinstance(self.format, ElementFormat):
            self.format = element_format(self.format)
        self.layout = scale_layout(self.layout)

    @classmethod
    def from_quantized(cls, q: Fp8Quantized, layout: ScaleLayout | Granularity) -> QuantizedTensor:
        return cls(tuple(q.data.shape), q.data.dtype, layout, q.data, q.scale_inv, q.data_t, q.scale_inv_t)

    # ---- the names FP8 code has always used ----
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.format.dtype

    @property
    def granularity(self) -> Granularity | ScaleLayout:
        """The layout's Granularity where it has one (today's four), else the layout itself."""
        return layout_granularity(self.layout)

    # ---- copies ----
    def row_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data is None:
            raise RuntimeError("this QuantizedTensor holds no row-major copy")
        return self.data, self.scale_inv

    def col_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data_t is None:
            raise RuntimeError("this QuantizedTensor holds no transposed copy: quantize with transpose=True")
        return self.data_t, self.scale_inv_t

    def t(self) -> QuantizedTensor:
        """The transposed operand: its row-major copy is this one's transposed copy (no bytes move)."""
        rows, cols = self.shape
        return replace(self, shape=(cols, rows), data=self.data_t, scale_inv=self.scale_inv_t, data_t=self.data,
                       scale_inv_t=self.scale_inv, global_scale_inv=self.global_scale_inv_t,
                       global_scale_inv_t=self.global_scale_inv)

    @property
    def is_microscaled(self) -> bool:
        """Scales stored as E8M0 or E4M3 bytes (MX, NVFP4), not fp32."""
        return self.layout.scale_format != ScaleFormat.FP32

    def with_transpose(self, power_of_2_scale: bool = False) -> QuantizedTensor:
        """This tensor with its transposed copy derived from the row-major one (if it lacks it).

        A layout whose transpose is a re-layout (one scale, square blocks): the same bytes moved (exact). Otherwise
        the transposed copy groups along the other axis, so the values are re-quantized (a second rounding; hand over
        `data_t` quantized from high precision to avoid it)."""
        if self.data_t is not None:
            return self
        if self.is_microscaled:
            return self._microscaled_with_transpose()
        data, scale_inv = self.row_major()
        if self.layout.transpose_is_relayout:
            return replace(self, data_t=data.t().contiguous(), scale_inv_t=scale_inv.t().contiguous())
        from .dispatch import quantize  # dispatch imports this module's neighbours; a late import breaks the cycle

        q = quantize(self.dequantize().t(), self.format.dtype, self.granularity, power_of_2_scale=power_of_2_scale)
        return replace(self, data_t=q.data, scale_inv_t=q.scale_inv)

    def _microscaled_with_transpose(self) -> QuantizedTensor:
        """Square tiles under one per-tensor scale (NVFP4's 16x16 weights): every code and scale moved, as
        quantize_microscaled(..., transpose=True) moves them. 1xN blocks group along the other axis: refused."""
        if not self.layout.transpose_is_relayout or self.data is None:
            raise NotImplementedError(f"a {self.layout.name} tensor's transposed copy is quantized from high precision "
                                      "(quantize_microscaled(..., transpose=True)), not derived from its row-major "
                                      "copy")
        codes = unpack_e2m1(self.data) if self.format.bits == 4 else self.data
        data_t = codes.t().contiguous()
        return replace(self, data_t=pack_e2m1(data_t) if self.format.bits == 4 else data_t,
                       scale_inv_t=self.scale_inv.t().contiguous(),
                       global_scale_inv_t=None if self.global_scale_inv is None else self.global_scale_inv.clone())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.is_microscaled:
            if self.data is not None:
                return dequantize_microscaled(self.data, self.scale_inv, self.format, self.layout,
                                              self.global_scale_inv).to(dtype)
            return dequantize_microscaled(self.data_t, self.scale_inv_t, self.format, self.layout,
                                          self.global_scale_inv_t).t().to(dtype)
        if self.data is not None:
            return dequantize(self.data, self.scale_inv, self.layout).to(dtype)
        return dequantize(self.data_t, self.scale_inv_t, self.layout).t().to(dtype)

    # ---- bytes ----
    def payload_nbytes(self, numel: int) -> int:
        """Bytes of one copy of `numel` elements: bits * numel / 8 rounded up (a packed 4-bit format is half a byte
        per element; never numel)."""
        return -(-numel * self.format.bits // 8)

    @property
    def nbytes(self) -> int:
        """The true size of every part this tensor holds: payload copies, their scales, the global scale."""
        total = 0
        for payload, scales in ((self.data, self.scale_inv), (self.data_t, self.scale_inv_t)):
            if payload is not None:
                total += payload.numel() * payload.element_size() + scales.numel() * scales.element_size()
        for global_scale in (self.global_scale_inv, self.global_scale_inv_t):
            if global_scale is not None:
                total += global_scale.numel() * global_scale.element_size()
        return total

    def block_scales_fp32(self) -> torch.Tensor:
        """The row-major copy's block scales as fp32 dequantization factors (telemetry reads these): E8M0 bytes
        decoded, E4M3 scales times the per-tensor decode scale; fp32 scales as they are."""
        _, scale_inv = self.row_major()
        scales = block_scale_values(scale_inv)
        return scales * self.global_scale_inv.float() if self.global_scale_inv is not None else scales

    @property
    def logical_numel(self) -> int:
        """Elements of the logical tensor (telemetry's denominator; data.numel() undercounts packed formats)."""
        return self.shape[0] * self.shape[1]


def wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat-able uint8 view where collectives reject its dtype (float8, packed formats):
    any 1-byte non-uint8 dtype is viewed as uint8; wider dtypes travel as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool) else t
