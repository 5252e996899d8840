"""Declared formats and layouts (kernels/formats.py): today's granularities as ScaleLayout constants, Fp8Format as
the old name of ElementFormat, and the GEMM's scale mode taken from the layouts the caller declares.

The case that motivated declaring: a 1x128 x 1x128 GEMM (wgrad) with K <= 128 has (M, 1) x (N, 1) scales, which
the shape guess takes for rowwise. Declared, it runs as blockwise 1x128: it refuses fast accumulation (blockwise
promotes every 128 of K) and is not a mode the auto backend sends to torch._scaled_mm's rowwise path on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from megafp8_kernels import (
    E4M3,
    E5M2,
    ElementFormat,
    Fp8Format,
    GemmScaleMode,
    Granularity,
    dequantize,
    fp8_format,
    fp8_gemm,
    quantize,
    scale_layout,
    scale_shape,
    scaled_mm_modes,
)
from megafp8_kernels.scaling import guess_gemm_mode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_old_names_are_the_element_formats():
    assert Fp8Format is ElementFormat and fp8_format(torch.float8_e4m3fn) is E4M3
    assert (E4M3.bits, E4M3.saturation_threshold, E5M2.saturation_threshold) == (8, 464.0, 61440.0)
    assert (E4M3.flush_threshold, E5M2.flush_threshold) == (2.0 ** -10, 2.0 ** -17)


@pytest.mark.parametrize("gran,expected_shape,relayout", [
    (Granularity.TENSORWISE, (), True),
    (Granularity.ROWWISE, (70, 1), False),
    (Granularity.BLOCK_1X128, (70, 3), False),
    (Granularity.BLOCK_128X128, (1, 3), True),
], ids=lambda v: v.value if isinstance(v, Granularity) else None)
def test_every_granularity_is_a_scale_layout_constant(gran, expected_shape, relayout):
    """The layout gives the scale shape of a (70, 300) operand and whether its transposed copy is the same bytes
    moved (Float8Tensor.with_transpose's rule), with fp32 one-level scales (the only kind today)."""
    layout = gran.layout
    assert scale_layout(gran) is layout and scale_layout(gran.value) is layout
    assert layout.scale_shape(70, 300) == scale_shape(70, 300, gran) == expected_shape
    assert layout.transpose_is_relayout is relayout
    assert (layout.scale_format.value, layout.two_level) == ("fp32", False)


def _blockwise_1x128_operands(M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    qa = quantize(torch.randn(M, K, generator=g), E4M3.dtype, Granularity.BLOCK_1X128, backend="reference")
    qb = quantize(torch.randn(N, K, generator=g), E4M3.dtype, Granularity.BLOCK_1X128, backend="reference")
    return qa, qb


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_1x128_gemm_with_k_up_to_128_runs_as_declared_not_as_guessed(backend):
    M, N, K = 48, 40, 96
    qa, qb = _blockwise_1x128_operands(M, N, K)
    assert qa.scale_inv.shape == (M, 1) and qb.scale_inv.shape == (N, 1)
    assert guess_gemm_mode(M, N, K, qa.scale_inv, qb.scale_inv) is GemmScaleMode.ROWWISE  # the old, wrong label
    assert GemmScaleMode.declared(Granularity.BLOCK_1X128, Granularity.BLOCK_1X128) is GemmScaleMode.BLOCKWISE_1X128

    layouts = (Granularity.BLOCK_1X128, Granularity.BLOCK_1X128)
    operands = [t.to(DEVICE) for t in (qa.data, qb.data, qa.scale_inv, qb.scale_inv)]
    got = fp8_gemm(*operands, layouts=layouts, backend=backend).cpu()
    exact = (dequantize(qa.data, qa.scale_inv, Granularity.BLOCK_1X128).double()
             @ dequantize(qb.data, qb.scale_inv, Granularity.BLOCK_1X128).double().t())
    # fp32 accumulation of 96 products of exactly representable values: relative error ~ 96 * 2^-24.
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())

    with pytest.raises(ValueError, match="blockwise_1x128 promotes every 128 of K"):
        fp8_gemm(*operands, layouts=layouts, fast_accum=True, backend=backend)
    fp8_gemm(*operands, fast_accum=True, backend=backend)  # the guess lets fast accumulation through
    assert GemmScaleMode.ROWWISE in scaled_mm_modes() and GemmScaleMode.BLOCKWISE_1X128 not in scaled_mm_modes()


@pytest.mark.parametrize("mode", list(GemmScaleMode), ids=lambda m: m.value)
def test_declaring_the_layouts_changes_no_bit_where_the_guess_was_right(mode):
    """K = 300 (three scale groups): every mode's shapes are unambiguous, so declared == guessed, bit for bit."""
    g = torch.Generator().manual_seed(1)
    gran_a, gran_b = mode.operand_granularities
    qa = quantize(torch.randn(70, 300, generator=g), E4M3.dtype, gran_a, backend="reference")
    qb = quantize(torch.randn(90, 300, generator=g), E4M3.dtype, gran_b, backend="reference")
    guessed = fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, backend="reference")
    declared = fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, layouts=(gran_a, gran_b), backend="reference")
    assert torch.equal(guessed, declared)


def test_declared_layouts_that_do_not_fit_the_scales_fail_with_the_expected_shape():
    qa, qb = _blockwise_1x128_operands(48, 40, 300)
    with pytest.raises(ValueError, match=r"scale_b of shape \(40, 3\) is not a block_128x128 scale .* expected \(1, 3\)"):
        fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, layouts=("block_1x128", "block_128x128"))
    with pytest.raises(ValueError, match="no FP8 GEMM for scale layouts rowwise x block_1x128"):
        fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, layouts=("rowwise", "block_1x128"))
    with pytest.raises(ValueError, match="unknown scale layout 'block_1x32'"):
        fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, layouts=("block_1x32", "block_1x128"))
