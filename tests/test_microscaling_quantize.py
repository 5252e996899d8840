"""The microscaling quantizers' torch twin (kernels/microscaling_reference.py) against oracles that are not ours:
torchao's `to_mx(..., RCEIL / FLOOR)` and `nvfp4_quantize` bit for bit (atol = rtol = 0), torchao's emulated MXTensor
GEMMs for a whole MXFP8 linear (fprop, dgrad, wgrad), and fp64 math for E2M1's ties, the NVFP4 16x16 tiles,
non-finite and zero blocks, stochastic rounding and the Hadamard transform; the wire/memory bytes are analytic."""
from __future__ import annotations

import math

import pytest
import torch

from megafp8.fp8 import Fp8Recipe
from megafp8.fp8.linear import Fp8Linear
from megafp8_kernels.formats import E2M1, E4M3, E5M2, MX_1X32, NVFP4_16X16, NVFP4_1X16
from megafp8_kernels.microscaling import quantize_microscaled
from megafp8_kernels.microscaling_reference import (
    e2m1_codes,
    e2m1_values,
    hadamard_matrix,
    random_hadamard_transform,
    unpack_e2m1,
)

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize  # noqa: E402

TORCHAO_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}


def _spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose rows span 12 binades: every block scale exponent is exercised."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows, base=2.0)[:, None]


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("rounding, torchao_mode", [("ceil", ScaleCalculationMode.RCEIL),
                                                    ("floor", ScaleCalculationMode.FLOOR)])
def test_mx_quantize_is_torchaos_bit_for_bit(fmt, rounding, torchao_mode):
    x = _spread(96, 256)
    q, _, _ = quantize_microscaled(x, fmt, MX_1X32, scale_rounding=rounding)
    scale, data = torchao_mx.to_mx(x, TORCHAO_DTYPE[fmt.name], 32, torchao_mode)
    assert torch.equal(q.scale_inv, scale.view(torch.uint8).reshape(q.scale_inv.shape))
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8).reshape(q.data.shape))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_1x16_is_torchaos_bit_for_bit(seed):
    """torchao's chain equals TransformerEngine's when S_enc is a power of two (then (amax / 6) / (1 / S_enc) and
    amax * (S_enc / 6) round alike); the tensor amax is set to 2688 / 2^9 so that it is."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).clamp(-4, 4)
    x[3, 5] = 2688 / 2**9
    q, _, _ = quantize_microscaled(x, E2M1, NVFP4_1X16)
    scales, data = nvfp4_quantize(x, 16, per_tensor_scale=x.abs().amax() / 2688)
    assert q.global_scale_inv.item() == 2.0 ** -9
    assert torch.equal(q.scale_inv.view(torch.uint8), scales.view(torch.uint8).reshape(q.scale_inv.shape))
    assert torch.equal(q.data, data.view(torch.uint8).reshape(q.data.shape))


def test_nvfp4_16x16_tiles_follow_the_scale_chain_in_fp64():
    x = _spread(48, 64, seed=3)
    q, _, _ = quantize_microscaled(x, E2M1, NVFP4_16X16, transpose=True)
    s_enc = 2688 / x.abs().amax().double()
    tiles = x.double().abs().reshape(3, 16, 4, 16).amax(dim=(1, 3))
    s_block = (tiles * s_enc / 6).clamp(max=448).float().to(torch.float8_e4m3fn)
    assert torch.equal(q.scale_inv.view(torch.uint8), s_block.view(torch.uint8))
    # Every value within half an E2M1 step of its block's grid, and the transposed copy the same bytes moved.
    decoded = q.dequantize().double()
    step = s_block.double().repeat_interleave(16, 0).repeat_interleave(16, 1) / s_enc
    assert ((decoded - x.double()).abs() <= step + 1e-12).all()
    assert torch.equal(q.t().dequantize(), q.dequantize().t())


def test_e2m1_rounds_ties_to_even_and_saturates():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.5, 100.0, -7.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 6.0, 6.0, -6.0])
    got = e2m1_values(e2m1_codes(ties))
    assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))


@pytest.mark.parametrize("layout, fmt", [(MX_1X32, E4M3), (MX_1X32, E2M1), (NVFP4_1X16, E2M1)])
def test_non_finite_blocks_dequantize_to_nan_and_zero_blocks_to_zero(layout, fmt):
    x = torch.randn(4, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    x[2] = 0.0
    out = quantize_microscaled(x, fmt, layout)[0].dequantize()
    if layout.two_level:  # one per-tensor scale: an inf anywhere makes the whole tensor loud
        assert out.isnan().all()
        return
    block = layout.block[1]
    assert out[0, :block].isnan().all() and out[1, 32:32 + block].isnan().all()
    assert torch.equal(out[2], torch.zeros(64))
    assert torch.isfinite(out[3]).all()


def test_stochastic_rounding_picks_a_neighbour_is_unbiased_and_keyed():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    nearest = quantize_microscaled(x, E2M1, NVFP4_1X16)[0]
    draws = [quantize_microscaled(x, E2M1, NVFP4_1X16, key=k)[0] for k in range(50)]
    # Same block scales; every code is one of the two grid neighbours of the scaled value.
    scaled = x / nearest.block_scales_fp32().repeat_interleave(16, 1)
    lo = e2m1_values(e2m1_codes(scaled.abs(), torch.zeros_like(scaled)))
    hi = e2m1_values(e2m1_codes(scaled.abs(), torch.full_like(scaled, 1 - 2**-24)))
    for q in draws[:5]:
        assert torch.equal(q.scale_inv.view(torch.uint8), nearest.scale_inv.view(torch.uint8))
        got = e2m1_values(unpack_e2m1(q.data)).abs()
        assert ((got == lo) | (got == hi)).all()
    mean = torch.stack([q.dequantize() for q in draws]).mean(0)
    rmse = lambda y: (y - x).pow(2).mean().sqrt()  # noqa: E731
    assert rmse(mean) < 0.5 * rmse(nearest.dequantize())  # TE's test: the mean of the draws beats round-to-nearest
    again = quantize_microscaled(x, E2M1, NVFP4_1X16, key=3)[0]
    assert torch.equal(again.data, draws[3].data) and not torch.equal(draws[3].data, draws[4].data)


def test_hadamard_transform_is_orthogonal_and_keeps_the_product():
    m = hadamard_matrix()
    assert torch.allclose(m @ m.t(), torch.eye(16, dtype=torch.float64), atol=1e-15, rtol=0)
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(12, 64, dtype=torch.float64)
    blocks = lambda t: (t.reshape(t.shape[0], -1, 16) @ m).reshape(t.shape)  # noqa: E731
    assert torch.allclose(blocks(a) @ blocks(b).t(), a @ b.t(), atol=1e-12, rtol=0)
    assert torch.equal(random_hadamard_transform(a.float()), blocks(a.float().double()).float())


def test_wgrad_with_and_without_hadamard_against_fp64():
    """wgrad = dY^T x quantized to NVFP4 along the tokens, with and without the transform, against fp64: both within
    E2M1's error (about 0.1 relative on Gaussian data). Measured here: the transform does not lower the error on
    Gaussian tokens or on a few outlier tokens (it spreads an outlier over its 16-token block, which then costs the
    other 15 their resolution too); the NVFP4 paper's gain is at scale, which the parity report measures."""
    g = torch.Generator().manual_seed(11)
    dy, x = torch.randn(256, 48, generator=g), torch.randn(256, 64, generator=g)
    exact = dy.double().t() @ x.double()
    errors = {}
    for rht in (False, True):
        a = quantize_microscaled(dy, E2M1, NVFP4_1X16, transpose=True, hadamard_transposed=rht)[0].t()
        b = quantize_microscaled(x, E2M1, NVFP4_1X16, transpose=True, hadamard_transposed=rht)[0].t()
        errors[rht] = ((a.dequantize().double() @ b.dequantize().double().t() - exact).norm() / exact.norm()).item()
    assert all(0 < e < 0.15 for e in errors.values()) and errors[True] != errors[False], errors


def test_mxfp8_linear_is_torchaos_emulated_gemms_bit_for_bit():
    """A whole MXFP8 linear (fprop, dgrad, wgrad) against torchao's MXTensor GEMMs (EMULATED), each operand quantized
    along its own K from high precision."""
    g = torch.Generator().manual_seed(5)
    x, w, dy = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g), torch.randn(64, 96, generator=g)
    layer = Fp8Linear(128, 96, bias=False, recipe=Fp8Recipe.named("mxfp8"))
    layer.weight.data.copy_(w)
    x_leaf = x.clone().requires_grad_()
    y = layer(x_leaf)
    y.backward(dy)

    def mx(t: torch.Tensor):
        return torchao_mx.MXTensor.to_mx(t.contiguous(), torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)

    assert torch.equal(y, torch.mm(mx(x), mx(w).t()))
    assert torch.equal(x_leaf.grad, torch.mm(mx(dy), mx(w.t()).t()))
    assert torch.equal(layer.weight.grad, torch.mm(mx(dy.t()), mx(x.t()).t()))


@pytest.mark.parametrize("layout, fmt, ratio", [(MX_1X32, E4M3, 0.515625), (NVFP4_1X16, E2M1, 0.28125),
                                                (MX_1X32, E2M1, 0.265625)])
def test_bytes_are_the_analytic_size_against_bf16(layout, fmt, ratio):
    """Payload + block scales of both copies over two BF16 copies (NVFP4 ~0.28x, MXFP8 ~0.52x, as the issue says);
    NVFP4's two per-tensor fp32 scales are the 8 bytes on top."""
    rows, cols = 64, 256
    q = quantize_microscaled(torch.randn(rows, cols), fmt, layout, transpose=True)[0]
    extra = 8 if layout.two_level else 0
    assert q.nbytes - extra == ratio * 2 * rows * cols * 2
    assert q.logical_numel == rows * cols and not math.isnan(q.dequantize().sum().item())


def test_a_16x16_nvfp4_tensor_derives_its_transposed_copy_by_moving_bytes():
    """QuantizedTensor.with_transpose (what a layer does with an NVFP4 weight handed over by --fp4-param-gather) gives
    the transposed copy quantize_microscaled(..., transpose=True) makes; a 1x16 or 1x32 copy is refused (its groups
    run along the other axis: that copy is quantized from high precision)."""
    from dataclasses import replace

    x = torch.randn(48, 80) * torch.logspace(-2, 2, 80)
    full = quantize_microscaled(x, E2M1, NVFP4_16X16, transpose=True)[0]
    derived = replace(full, data_t=None, scale_inv_t=None, global_scale_inv_t=None).with_transpose()
    assert torch.equal(derived.data_t, full.data_t)
    assert torch.equal(derived.scale_inv_t.view(torch.uint8), full.scale_inv_t.view(torch.uint8))
    assert torch.equal(derived.global_scale_inv_t, full.global_scale_inv_t)
    assert torch.equal(derived.dequantize(), full.dequantize())
    for fmt, layout in ((E2M1, NVFP4_1X16), (E4M3, MX_1X32)):
        row_major = quantize_microscaled(x, fmt, layout)[0]
        with pytest.raises(NotImplementedError, match="quantized from high precision"):
            row_major.with_transpose()
