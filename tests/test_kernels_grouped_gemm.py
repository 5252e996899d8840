"""Grouped FP8 GEMMs (megafp8_kernels.grouped_gemm: fprop/dgrad grouped by rows, wgrad grouped by columns): the Triton
kernels (interpreter on CPU) against their twins, the twins against the loop of plain FP8 GEMMs they stand for (to the
bit), and both against fp64.

Groups of uneven sizes, empty ones among them, none a multiple of the tiles: a tile's loads reach into the next group's
rows of A and B, which must never reach the output. SQNR floors as in test_kernels_gemm.py."""
import itertools
import re

import pytest
import torch

from fp8_testing import sqnr_db
from megafp8_kernels import E4M3, E5M2, GemmScaleMode, fp8_gemm, quantize
from megafp8_kernels.grouped_gemm import columns_side_by_side, grouped_fp8_gemm, grouped_fp8_wgrad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = [GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE]
SIZES = [37, 0, 5, 64, 0, 19]  # rows per group


def _operands(sizes, N, K, mode, seed, fmt_a=E4M3, fmt_b=E4M3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), K, generator=g)
    weights = torch.randn(len(sizes), N, K, generator=g) * 0.05
    gran_a, gran_b = mode.operand_granularities
    qa = quantize(x, fmt_a.dtype, gran_a, backend="reference")
    qbs = [quantize(w, fmt_b.dtype, gran_b, backend="reference") for w in weights]
    b = torch.stack([q.data for q in qbs])
    sb = torch.stack([q.scale_inv for q in qbs])
    ends = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32)
    return x, weights, qa.data, b, qa.scale_inv, sb, ends


def _loop(a, b, sa, sb, sizes, mode, out_dtype=torch.float32):
    """The loop of plain FP8 GEMMs, one per group."""
    outs, start = [], 0
    for group, n in enumerate(sizes):
        if n:
            outs.append(fp8_gemm(a[start:start + n], b[group], sa[start:start + n], sb[group], out_dtype=out_dtype,
                                 layouts=mode.operand_layouts, backend="reference"))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
def test_twin_is_the_loop_and_triton_matches_it(mode, fmts):
    N, K = 72, 300  # N spans two 64-wide tiles, the last partial: a tile reads the next group's B rows
    _, _, a, b, sa, sb, ends = _operands(SIZES, N, K, mode, 1, *fmts)
    loop = _loop(a, b, sa, sb, SIZES, mode)
    twin = grouped_fp8_gemm(a, b, sa, sb, ends, layouts=mode.operand_layouts, backend="reference")
    assert torch.equal(twin, loop)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = grouped_fp8_gemm(*(t.to(DEVICE) for t in (a, b, sa, sb, ends)), layouts=mode.operand_layouts,
                               out_dtype=out_dtype, backend="triton")
        assert got.dtype == out_dtype and torch.isfinite(got).all()
        assert sqnr_db(got.cpu().float(), loop) >= (50.0 if out_dtype == torch.float32 else 40.0)


def test_fast_accum_and_contiguous_1x128_scales():
    """Rowwise with fast_accum (fprop), and blockwise with row-major 1x128 scales (a concatenation of experts'
    scales), which the kernel reads by strides."""
    _, _, a, b, sa, sb, ends = _operands(SIZES, 40, 260, GemmScaleMode.ROWWISE, 2)
    got = grouped_fp8_gemm(*(t.to(DEVICE) for t in (a, b, sa, sb, ends)), layouts=("rowwise", "rowwise"),
                           fast_accum=True, backend="triton")
    assert sqnr_db(got.cpu(), _loop(a, b, sa, sb, SIZES, GemmScaleMode.ROWWISE)) >= 50.0
    mode = GemmScaleMode.BLOCKWISE
    _, _, a, b, sa, sb, ends = _operands(SIZES, 40, 260, mode, 3)
    assert sa.stride(0) == 1  # the quantizer's K-block-major 1x128 scales
    got = grouped_fp8_gemm(*(t.to(DEVICE) for t in (a, b, sa.contiguous(), sb, ends)), layouts=mode.operand_layouts,
                           backend="triton")
    assert sqnr_db(got.cpu(), _loop(a, b, sa, sb, SIZES, mode)) >= 50.0


@pytest.mark.parametrize("mode,floor_db", [(GemmScaleMode.ROWWISE, 25.0), (GemmScaleMode.BLOCKWISE, 28.0)],
                         ids=lambda v: getattr(v, "value", str(v)))
def test_grouped_gemm_vs_fp64(mode, floor_db):
    """Quantize-then-grouped-GEMM against each group's fp64 product of the original values."""
    x, weights, a, b, sa, sb, ends = _operands([90, 3, 0, 140], 160, 512, mode, 4)
    expected = torch.cat([x[s:e].double() @ w.double().t() for s, e, w in
                          zip([0, *ends.tolist()[:-1]], ends.tolist(), weights)])
    for backend in ("reference", "triton"):
        got = grouped_fp8_gemm(*(t.to(DEVICE) for t in (a, b, sa, sb, ends)), layouts=mode.operand_layouts,
                               backend=backend)
        assert sqnr_db(got.cpu(), expected) >= floor_db, backend


def test_default_hopper_tiles_match_the_twin():
    """The GPU launch config's real 128x128x128 tiles (the interpreter's small tiles could hide an edge bug)."""
    from megafp8_kernels import grouped_gemm_triton

    mode = GemmScaleMode.BLOCKWISE
    sizes = [150, 0, 7, 130]
    _, _, a, b, sa, sb, ends = _operands(sizes, 200, 300, mode, 5)
    got, _ = grouped_gemm_triton.grouped_fp8_gemm_triton(*(t.to(DEVICE) for t in (a, b, sa, sb, ends)), mode,
                                                          config=grouped_gemm_triton.SM90_CONFIG)
    assert sqnr_db(got.cpu(), _loop(a, b, sa, sb, sizes, mode)) >= 50.0


@pytest.mark.parametrize("change,message", [
    (dict(layouts=("tensorwise", "tensorwise")), "rowwise (PER_ROW x PER_ROW"),
    (dict(layouts=("block_1x128", "block_128x128"), fast_accum=True), "fast_accum=True is for rowwise"),
    (dict(ends=torch.tensor([1.0])), "group_ends must be an int32/int64 vector"),
    (dict(b=torch.zeros(4, 8, 128, dtype=torch.float8_e4m3fn).flatten(0, 1)), "B (groups, N, K)"),
])
def test_bad_arguments_say_what_to_pass(change, message):
    mode = GemmScaleMode.BLOCKWISE
    _, _, a, b, sa, sb, ends = _operands([3, 5], 8, 128, mode, 6)
    args = dict(a=a, b=b, sa=sa, sb=sb, ends=ends, layouts=mode.operand_layouts, fast_accum=False) | change
    with pytest.raises(ValueError, match=re.escape(message)):
        grouped_fp8_gemm(args["a"], args["b"], args["sa"], args["sb"], args["ends"], layouts=args["layouts"],
                         fast_accum=args["fast_accum"])


def _wgrad_operands(sizes, M, N, mode, seed):
    """Each group's transposed copies dY_g^T (M, size) and X_g^T (N, size) (wgrad's operands), and the values."""
    g = torch.Generator().manual_seed(seed)
    dys = [torch.randn(n, M, generator=g) for n in sizes]
    xs = [torch.randn(n, N, generator=g) for n in sizes]
    gran = mode.operand_granularities[0]
    qd = [quantize(d, E5M2.dtype, gran, transpose=True, backend="reference") if len(d) else None for d in dys]
    qx = [quantize(x, E4M3.dtype, gran, transpose=True, backend="reference") if len(x) else None for x in xs]
    return dys, xs, qd, qx


def _side_by_side(qs, sizes, M, mode, fp8_dtype):
    """The grouped operand: payloads side by side (padded), scales as the mode wants them."""
    empty = lambda: torch.zeros(M, 0, dtype=fp8_dtype)  # noqa: E731
    data = columns_side_by_side([q.data_t if q is not None else empty() for q in qs])
    if mode == GemmScaleMode.ROWWISE:
        scales = torch.stack([q.scale_inv_t if q is not None else torch.ones(M, 1) for q in qs])
    else:
        scales = torch.cat([q.scale_inv_t for q in qs if q is not None], dim=1)
    return data, scales


@pytest.mark.parametrize("mode", [GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE_1X128], ids=lambda m: m.value)
def test_grouped_wgrad_twin_is_the_loop_and_triton_matches_it(mode):
    sizes, M, N = [37, 0, 200, 16, 130], 72, 40  # 200 and 130 tokens: two 1x128 groups each, the second partial
    dys, xs, qd, qx = _wgrad_operands(sizes, M, N, mode, 7)
    a, sa = _side_by_side(qd, sizes, M, mode, E5M2.dtype)
    b, sb = _side_by_side(qx, sizes, N, mode, E4M3.dtype)
    assert a.shape[1] == 128 * (1 + 0 + 2 + 1 + 2)
    counts = torch.tensor(sizes, dtype=torch.int32)
    loop = torch.stack([fp8_gemm(d.data_t, x.data_t, d.scale_inv_t, x.scale_inv_t, layouts=mode.operand_layouts,
                                 backend="reference") if d is not None else torch.zeros(M, N)
                        for d, x in zip(qd, qx)])
    twin = grouped_fp8_wgrad(a, b, sa, sb, counts, layouts=mode.operand_layouts, backend="reference")
    assert torch.equal(twin, loop)
    got = grouped_fp8_wgrad(*(t.to(DEVICE) for t in (a, b, sa, sb, counts)), layouts=mode.operand_layouts,
                            backend="triton")
    assert got.shape == (len(sizes), M, N) and torch.equal(got[1].cpu(), torch.zeros(M, N))
    assert sqnr_db(got.cpu(), loop) >= 50.0
    exact = torch.stack([d.double().t() @ x.double() for d, x in zip(dys, xs)])
    assert sqnr_db(got.cpu(), exact) >= 20.0  # E5M2 x E4M3 products


def test_grouped_wgrad_refuses_unpadded_columns_and_wrong_scales():
    mode = GemmScaleMode.BLOCKWISE_1X128
    _, _, qd, qx = _wgrad_operands([20, 30], 16, 8, mode, 8)
    a, sa = _side_by_side(qd, [20, 30], 16, mode, E5M2.dtype)
    b, sb = _side_by_side(qx, [20, 30], 8, mode, E4M3.dtype)
    counts = torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="padded to a multiple of 128"):
        grouped_fp8_wgrad(a[:, :200], b[:, :200], sa, sb, counts, layouts=mode.operand_layouts)
    with pytest.raises(ValueError, match=re.escape("scale_b of a blockwise_1x128 grouped wgrad must be a float32 (8, 2)")):
        grouped_fp8_wgrad(a, b, sa, sb[:, :1], counts, layouts=mode.operand_layouts)
