"""Float8Tensor: an FP8 payload with its scales and layouts (the collectives move its parts as uint8 views).

A plain container, not a torch.Tensor subclass: it only travels between the quantizer, the GEMMs and
the collectives, never through arbitrary torch ops, so a subclass would add dispatch rules and no value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megafp8_kernels import Fp8Quantized, Granularity, dequantize, quantize


@dataclass
class Float8Tensor:
    """A 2-D (rows, cols) tensor in FP8.

    data / scale_inv:     row-major FP8 bytes and dequantization scales (groups along cols)
    data_t / scale_inv_t: the transposed (cols, rows) copy, groups along rows; present when a GEMM
                          needs the tensor K-major the other way round (dgrad, wgrad)
    Either layout may be absent: a weight kept only for dgrad holds just the transposed copy.
    """

    shape: tuple[int, int]
    fp8_dtype: torch.dtype
    granularity: Granularity
    data: torch.Tensor | None = None
    scale_inv: torch.Tensor | None = None
    data_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None

    @classmethod
    def from_quantized(cls, q: Fp8Quantized, granularity: Granularity) -> Float8Tensor:
        return cls(tuple(q.data.shape), q.data.dtype, granularity, q.data, q.scale_inv, q.data_t, q.scale_inv_t)

    def row_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data is None:
            raise RuntimeError("this Float8Tensor holds no row-major copy")
        return self.data, self.scale_inv

    def col_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data_t is None:
            raise RuntimeError("this Float8Tensor holds no transposed copy: quantize with transpose=True")
        return self.data_t, self.scale_inv_t

    def with_transpose(self, power_of_2_scale: bool = False) -> Float8Tensor:
        """This tensor with its transposed copy derived from the row-major one (if it lacks it).

        Tensorwise and 128x128 tiles: the same groups, so the same bytes moved (exact). Rowwise: the
        transposed copy has one scale per column, so the FP8 values are re-quantized along the other axis
        (a second rounding; hand over `data_t` quantized from high precision to avoid it)."""
        if self.data_t is not None:
            return self
        data, scale_inv = self.row_major()
        if self.granularity in (Granularity.TENSORWISE, Granularity.BLOCK_128X128):
            return replace(self, data_t=data.t().contiguous(), scale_inv_t=scale_inv.t().contiguous())
        q = quantize(self.dequantize().t(), self.fp8_dtype, self.granularity, power_of_2_scale=power_of_2_scale)
        return replace(self, data_t=q.data, scale_inv_t=q.scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.data is not None:
            return dequantize(self.data, self.scale_inv, self.granularity).to(dtype)
        return dequantize(self.data_t, self.scale_inv_t, self.granularity).t().to(dtype)
