"""The precise FP8 GEMM promotes exactly as DeepGEMM does: acc = acc + partial_k * sa_k * sb_k in fp32, K step by K step.

Bit-exact against an independent torch emulation of that order, on operands whose 128-wide partial
products are exact in fp32 (small integers in E4M3), so only the promotion's roundings remain; the
scales are not powers of two, so any other order or grouping gives different bits (checked too).
The Hopper Gluon kernel (kernels/gemm_hopper.py) keeps this expression and order; the interpreter runs
gemm.py's kernel, which it shares them with.
"""
import pytest
import torch

from megafp8_kernels import GemmScaleMode, gemm
from megafp8_kernels.scaling import BLOCK, empty_scales

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _integer_fp8(rows, cols, generator):
    """FP8 E4M3 holding integers in [-8, 8]: 128 products sum exactly in fp32 in any order."""
    return torch.randint(-8, 9, (rows, cols), generator=generator).float().to(torch.float8_e4m3fn)


def _random_scales(rows, cols, gran, generator):
    scales = empty_scales(rows, cols, gran)
    scales.copy_(torch.rand(scales.shape, generator=generator) * 3 + 0.1)
    return scales


def _promoted_reference(a, b, sa, sb, mode, k_order):
    """fp32 emulation of the promotion: per 128-wide K step, an exact fp64 partial (rounded to fp32, exact
    here), then acc + (partial * sa[m, k]) * sb[n, k] elementwise in fp32."""
    (M, K), N = a.shape, b.shape[0]
    acc = torch.zeros(M, N)
    for k in k_order:
        cols = slice(k * BLOCK, min((k + 1) * BLOCK, K))
        partial = (a[:, cols].double() @ b[:, cols].double().t()).float()
        sb_k = sb[torch.arange(N) // BLOCK, k] if mode is GemmScaleMode.BLOCKWISE else sb[:, k]
        acc = acc + partial * sa[:, k][:, None] * sb_k[None, :]
    return acc


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


PRECISE_KERNELS = ["triton", pytest.param("gluon", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("precise_kernel", PRECISE_KERNELS)
@pytest.mark.parametrize("mode", [GemmScaleMode.BLOCKWISE, GemmScaleMode.BLOCKWISE_1X128], ids=lambda m: m.value)
def test_promotion_is_bit_exact_deepgemm_order(mode, precise_kernel):
    if precise_kernel == "gluon" and not _hopper():
        pytest.skip("the Gluon kernel is Hopper-only")
    g = torch.Generator().manual_seed(11)
    M, N, K = 70, 150, 640  # five K steps (a pair loop and an odd tail), N across two 128-row blocks of B
    a, b = _integer_fp8(M, K, g), _integer_fp8(N, K, g)
    gran_a, gran_b = mode.operand_granularities
    sa, sb = _random_scales(M, K, gran_a, g), _random_scales(N, K, gran_b, g)
    got = gemm.fp8_gemm_triton(a.to(DEVICE), b.to(DEVICE), sa.to(DEVICE), sb.to(DEVICE),
                               precise_kernel=precise_kernel).cpu()
    k_steps = -(-K // BLOCK)
    expected = _promoted_reference(a, b, sa, sb, mode, range(k_steps))
    if DEVICE == "cpu":  # the interpreter: numpy's fp32, no FMA contraction
        assert torch.equal(got, expected)
    else:  # a GPU contracts the last multiply-add into an FMA: one rounding fewer per step
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # The check sees the order: promoting the same partials in reverse changes some bits.
    assert not torch.equal(expected, _promoted_reference(a, b, sa, sb, mode, reversed(range(k_steps))))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(GemmScaleMode), ids=lambda m: m.value)
def test_gluon_precise_kernel_matches_twin(mode):
    """The Hopper Gluon kernel (MEGAFP8_GEMM_PRECISE_KERNEL=gluon) against the torch twin: odd and aligned
    sizes (one, even and odd K step counts), every output dtype, bias and accumulate. Not run on CPU."""
    if not _hopper():
        pytest.skip("the Gluon kernel is Hopper-only")
    from fp8_testing import sqnr_db
    from megafp8_kernels import E4M3, quantize
    from megafp8_kernels.gemm_reference import fp8_gemm_reference

    g = torch.Generator().manual_seed(3)
    gran_a, gran_b = mode.operand_granularities
    for (M, N, K), out_dtype, extras in [((1, 1, 1), torch.float32, False), ((70, 90, 300), torch.bfloat16, True),
                                         ((200, 260, 1000), torch.float16, True), ((512, 512, 512), torch.float32, False),
                                         ((1024, 768, 4096), torch.bfloat16, True)]:
        qa = quantize(torch.randn(M, K, generator=g), E4M3.dtype, gran_a, backend="reference")
        qb = quantize(torch.randn(N, K, generator=g), E4M3.dtype, gran_b, backend="reference")
        bias = torch.randn(N, generator=g) if extras else None
        start = torch.randn(M, N, generator=g).to(out_dtype) if extras else torch.full((M, N), float("nan")).to(out_dtype)
        expected = fp8_gemm_reference(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=out_dtype, bias=bias,
                                      out=start.clone(), accumulate=extras)
        out = start.clone().cuda()
        gemm.fp8_gemm_triton(qa.data.cuda(), qb.data.cuda(), qa.scale_inv.cuda(), qb.scale_inv.cuda(),
                             out_dtype=out_dtype, bias=bias.cuda() if extras else None, out=out, accumulate=extras,
                             precise_kernel="gluon")
        floor = 50.0 if out_dtype == torch.float32 else 40.0
        assert torch.isfinite(out).all() and sqnr_db(out.float().cpu(), expected.float()) >= floor, (M, N, K)


def test_unknown_precise_kernel_names_the_variable(monkeypatch):
    a = torch.zeros(4, 16, dtype=torch.float8_e4m3fn)
    monkeypatch.setenv(gemm.PRECISE_KERNEL_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MEGAFP8_GEMM_PRECISE_KERNEL='fast'"):
        gemm.fp8_gemm_triton(a, a, torch.ones(()), torch.ones(()))
