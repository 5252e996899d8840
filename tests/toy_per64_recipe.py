"""A test-only recipe, "fp8 with per-64 blocks", added the way issue 36 promises a new format is added: one quantizer
(with its twin, the cast), one recipe entry. Nothing else in megafp8 changes. Run as a script, it registers the
recipe and then runs the training entry with the remaining arguments (`--fp8-recipe toy_per64`)."""
from __future__ import annotations

import sys

import torch

from megafp8.fp8 import Quantized, Quantizer, QuantizedTensor, ScalingRule, register_scaling, scaling_names
from megafp8_kernels import ScaleLayout
from megafp8_kernels.quantize_reference import cast_counts, reciprocal, saturating_cast, scale_from_amax

BLOCK_1X64 = ScaleLayout("block_1x64", (1, 64))  # one fp32 scale per row per 64 columns (K)


class Per64Quantizer(Quantizer):
    """The twin: per-(1 x 64) amax, FORMAT_MAX / amax scales, the kernels' saturating cast; the transposed copy
    quantized from high precision along the other axis."""

    def cast(self, x2d: torch.Tensor, *, scale: torch.Tensor | None, transpose: bool, stats: bool) -> Quantized:
        data, scale_inv, amax, counts = self._rows(x2d.float(), stats)
        data_t = scale_inv_t = None
        if transpose:
            data_t, scale_inv_t, _, _ = self._rows(x2d.float().t(), False)
        tensor = QuantizedTensor(tuple(x2d.shape), self.format, self.layout, data, scale_inv, data_t, scale_inv_t)
        return Quantized(tensor, amax, counts)

    def _rows(self, x32: torch.Tensor, stats: bool):
        rows, cols = x32.shape
        padded = torch.nn.functional.pad(x32.abs(), (0, -cols % 64))
        amax = padded.view(rows, -1, 64).amax(dim=2)
        scale = scale_from_amax(amax, self.format.max, self.power_of_2_scale)
        scaled = x32 * scale.repeat_interleave(64, dim=1)[:, :cols]
        counts = cast_counts(x32, scaled, self.format) if stats else None
        return saturating_cast(scaled, self.format), reciprocal(scale), amax, counts


# The recipe entry: every role and GEMM in 1x64 blocks, current scaling, fp32 promotion (no fast-accumulation kernel).
RULE = ScalingRule(lambda role, gemm: BLOCK_1X64, fast_accum=False, default_format="e4m3", quantizer=Per64Quantizer)


def register() -> None:
    if "toy_per64" not in scaling_names():
        register_scaling("toy_per64", RULE)


if __name__ == "__main__":
    register()
    from megafp8 import pretrain

    sys.exit(pretrain.main(sys.argv[1:]))
