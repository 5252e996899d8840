"""FP8 GEMM: Triton against its twin on the same FP8 inputs, and FP8 numerics against fp64 on real-valued inputs.

Tolerances are SQNR floors (dB), never bit equality: the kernel scales after each dot (or per 128-wide
K step) while the twin dequantizes first, so fp32 rounding differs; 50 dB is ~3 decimal digits, far
looser than that rounding (~130 dB) and far tighter than any indexing or scaling bug (< 10 dB).
"""
import itertools

import pytest
import torch

from fp8_testing import gaussian_with_outlier_channels, sqnr_db
from megafp8_kernels import E4M3, E5M2, GemmScaleMode, fp8_gemm, quantize
from megafp8_kernels.gemm_reference import fp8_gemm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
MODES = list(GemmScaleMode)
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 1), (70, 90, 300), (129, 33, 257)]  # (M, N, K), none a multiple of the tiles


def _operands(M, N, K, fmt_a, fmt_b, mode, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    gran_a, gran_b = mode.operand_granularities
    qa = quantize(x, fmt_a.dtype, gran_a, backend="reference")
    qb = quantize(w, fmt_b.dtype, gran_b, backend="reference")
    return qa.data, qb.data, qa.scale_inv, qb.scale_inv


def _to(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


@pytest.mark.parametrize("fmts,mode", list(itertools.product(DTYPE_PAIRS, MODES)),
                         ids=lambda v: v.value if isinstance(v, GemmScaleMode) else f"{v[0].dtype}x{v[1].dtype}")
def test_triton_matches_reference(fmts, mode):
    """Every dtype pair x scale mode x output dtype x bias x accumulate, on odd shapes."""
    seed = 0
    for (M, N, K), out_dtype, with_bias, accumulate in itertools.product(SHAPES, OUT_DTYPES, [False, True], [False, True]):
        seed += 1
        a, b, sa, sb = _operands(M, N, K, *fmts, mode, seed)
        bias = torch.randn(N, generator=torch.Generator().manual_seed(seed)) if with_bias else None
        if accumulate:
            start = torch.randn(M, N, generator=torch.Generator().manual_seed(-seed)).to(out_dtype)
        else:
            start = torch.full((M, N), float("nan"), dtype=out_dtype)  # poison: an unwritten element fails
        expected = fp8_gemm_reference(a, b, sa, sb, out_dtype=out_dtype, bias=bias, out=start.clone(), accumulate=accumulate)
        out = start.clone().to(DEVICE)
        got = fp8_gemm(*_to(DEVICE, a, b, sa, sb), out_dtype=out_dtype, bias=_to(DEVICE, bias)[0], out=out,
                       accumulate=accumulate, backend="triton")
        assert got.data_ptr() == out.data_ptr(), "the result must be written into `out`"
        assert torch.isfinite(got).all(), f"unwritten or non-finite output for {(M, N, K)}"
        floor = 50.0 if out_dtype == torch.float32 else 40.0  # bf16 output rounding alone is ~50 dB
        assert sqnr_db(got.cpu(), expected) >= floor, (M, N, K, out_dtype, with_bias, accumulate)


@pytest.mark.parametrize("mode,floor_db", [(GemmScaleMode.TENSORWISE, 25.0), (GemmScaleMode.ROWWISE, 25.0),
                                           (GemmScaleMode.BLOCKWISE, 28.0), (GemmScaleMode.BLOCKWISE_1X128, 28.0)],
                         ids=lambda v: getattr(v, "value", str(v)))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_gemm_vs_fp64_on_outlier_channels(mode, floor_db, backend):
    """Quantize-then-GEMM of Gaussian data with outlier channels vs the fp64 GEMM of the original data.

    Fresh inputs per case. E4M3 keeps 3 mantissa bits (~28.6 dB for a Gaussian product); coarse
    scaling groups lose more when outlier channels dominate a group.
    """
    g = torch.Generator().manual_seed(2 * MODES.index(mode) + (backend == "triton"))
    M, N, K = 96, 160, 512
    x = gaussian_with_outlier_channels(M, K, g)
    w = torch.randn(N, K, generator=g) * 0.02
    gran_a, gran_b = mode.operand_granularities
    qa = quantize(x.to(DEVICE), E4M3.dtype, gran_a, backend=backend if DEVICE == "cpu" else None)
    qb = quantize(w.to(DEVICE), E4M3.dtype, gran_b, backend=backend if DEVICE == "cpu" else None)
    out = fp8_gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, backend=backend)
    assert sqnr_db(out.cpu(), x.double() @ w.double().t()) >= floor_db


def test_gradient_formats_vs_fp64():
    """E5M2 operands (gradients) keep 2 mantissa bits: ~6 dB under E4M3; 22 dB is the floor for a Gaussian."""
    g = torch.Generator().manual_seed(5)
    dy, w = torch.randn(64, 256, generator=g), torch.randn(256, 192, generator=g)
    qa = quantize(dy, E5M2.dtype, "block_1x128", backend="reference")
    qb = quantize(w.t().contiguous(), E4M3.dtype, "block_128x128", backend="reference")
    for backend in ("reference", "triton"):
        out = fp8_gemm(*_to(DEVICE, qa.data, qb.data, qa.scale_inv, qb.scale_inv), backend=backend)
        assert sqnr_db(out.cpu(), dy.double() @ w.double()) >= 22.0


def test_triton_reads_any_scale_layout():
    """The quantizer's K-block-major 1x128 scales and row-major copies of them (what a sequence-parallel
    gather returns) give the same product."""
    a, b, sa, sb = _operands(70, 90, 300, E4M3, E4M3, GemmScaleMode.BLOCKWISE_1X128, 3)
    assert sa.stride() == (1, 70) and sb.stride() == (1, 90)
    expected = fp8_gemm_reference(a, b, sa, sb)
    for sa_, sb_ in ((sa, sb), (sa.contiguous(), sb.contiguous()), (sa, sb.contiguous())):
        got = fp8_gemm(*_to(DEVICE, a, b, sa_, sb_), backend="triton")
        assert sqnr_db(got.cpu(), expected) >= 50.0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_default_hopper_config_tiles_match_reference(mode):
    """The kernel at the default launch config's real tile sizes (128x128x128; the interpreter's usual
    32x32 tiles would hide tile-edge bugs), through the config path kernel_resources.py uses."""
    from megafp8_kernels import gemm

    a, b, sa, sb = _operands(200, 260, 300, E4M3, E4M3, mode, 6)
    expected = fp8_gemm_reference(a, b, sa, sb)
    out = torch.full((200, 260), float("nan"), device=DEVICE)
    hopper_or_cpu = DEVICE == "cpu" or torch.cuda.get_device_capability()[0] == 9
    config = gemm.SM90_DEFAULT_CONFIG if hopper_or_cpu else gemm.FALLBACK_DEFAULT_CONFIG
    got, _ = gemm.fp8_gemm_triton(*_to(DEVICE, a, b, sa, sb), out=out, config=config)
    assert got is out and sqnr_db(got.cpu(), expected) >= 50.0


@pytest.mark.parametrize("mode,out_dtype", [(GemmScaleMode.TENSORWISE, torch.float32), (GemmScaleMode.TENSORWISE, torch.bfloat16),
                                            (GemmScaleMode.ROWWISE, torch.bfloat16)], ids=str)
def test_scaled_mm_backend_matches_reference(mode, out_dtype):
    """torch._scaled_mm receives our operands and scales in the layout it wants (on CPU it has a kernel
    too, so the plumbing is tested here; its CUDA speed is gpu_check.sh's business)."""
    a, b, sa, sb = _operands(64, 96, 256, E4M3, E4M3, mode, 4)
    expected = fp8_gemm_reference(a, b, sa, sb, out_dtype=out_dtype)
    got = fp8_gemm(*_to(DEVICE, a, b, sa, sb), out_dtype=out_dtype, backend="scaled_mm")
    assert sqnr_db(got.float().cpu(), expected.float()) >= 40.0
    out = torch.full((64, 96), float("nan"), dtype=out_dtype, device=DEVICE)
    assert fp8_gemm(*_to(DEVICE, a, b, sa, sb), out_dtype=out_dtype, out=out, backend="scaled_mm") is out
    assert sqnr_db(out.float().cpu(), expected.float()) >= 40.0


def test_dispatch_sends_eligible_cuda_gemms_to_scaled_mm(monkeypatch):
    """The auto backend's per-mode choice, decided on fake CUDA tensors (no GPU needed to decide)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megafp8_kernels import SCALED_MM_ENV_VAR, resolve_gemm_backend

    monkeypatch.delenv("MEGAFP8_KERNEL_BACKEND", raising=False)
    monkeypatch.delenv(SCALED_MM_ENV_VAR, raising=False)
    T, R, B = GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE, GemmScaleMode.BLOCKWISE
    with FakeTensorMode():
        a = torch.empty(256, 512, device="cuda", dtype=E4M3.dtype)
        b = torch.empty(128, 512, device="cuda", dtype=E4M3.dtype)
        e5 = torch.empty(256, 512, device="cuda", dtype=E5M2.dtype)
        odd = torch.empty(100, 512, device="cuda", dtype=E4M3.dtype)
        bias = torch.empty(128, device="cuda")
        assert resolve_gemm_backend(T, a, b, torch.bfloat16, None, False) == "scaled_mm"
        assert resolve_gemm_backend(R, a, b, torch.bfloat16, None, False) == "scaled_mm"
        assert resolve_gemm_backend(R, a, b, torch.float32, None, False) == "triton"  # rowwise: bf16 out only
        assert resolve_gemm_backend(R, e5, b, torch.bfloat16, None, False) == "triton"
        assert resolve_gemm_backend(T, e5, b, torch.bfloat16, None, False) == "scaled_mm"
        assert resolve_gemm_backend(B, a, b, torch.bfloat16, None, False) == "triton"
        assert resolve_gemm_backend(T, a, b, torch.float32, None, True) == "triton"  # accumulate: fused epilogue
        assert resolve_gemm_backend(T, a, b, torch.float32, bias, False) == "triton"
        assert resolve_gemm_backend(T, a, odd, torch.float32, None, False) == "triton"  # N % 16
        assert resolve_gemm_backend(T, a, b, torch.bfloat16, None, False, backend="triton") == "triton"
        monkeypatch.setenv(SCALED_MM_ENV_VAR, "rowwise")
        assert resolve_gemm_backend(T, a, b, torch.bfloat16, None, False) == "triton"
        assert resolve_gemm_backend(R, a, b, torch.bfloat16, None, False) == "scaled_mm"
        monkeypatch.setenv(SCALED_MM_ENV_VAR, "none")
        assert resolve_gemm_backend(R, a, b, torch.bfloat16, None, False) == "triton"
        monkeypatch.setenv(SCALED_MM_ENV_VAR, "blockwise")
        with pytest.raises(ValueError, match=SCALED_MM_ENV_VAR):
            resolve_gemm_backend(R, a, b, torch.bfloat16, None, False)
    cpu = torch.empty(256, 512, dtype=E4M3.dtype)
    monkeypatch.delenv(SCALED_MM_ENV_VAR)
    assert resolve_gemm_backend(T, cpu, cpu, torch.bfloat16, None, False) == "reference", "CPU keeps the twin"
    with pytest.raises(ValueError, match="cannot run this GEMM"):
        resolve_gemm_backend(B, cpu, cpu, torch.bfloat16, None, False, backend="scaled_mm")


def test_offered_hopper_configs_fit_the_register_budget():
    """The reasoning in gemm.py as an invariant: two fp32 accumulator tiles (running sum + per-K-step
    dot) take at most 128 of a thread's 255 registers in every offered config, the default included,
    and it is what an untuned launch uses (tests/test_gemm_autotune_policy.py)."""
    from megafp8_kernels import gemm

    def acc_regs(cfg):
        return 2 * cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] // (32 * cfg.num_warps)

    assert gemm.SM90_DEFAULT_CONFIG is gemm.SM90_CONFIGS[0]
    assert all(acc_regs(cfg) <= 128 for cfg in gemm.SM90_CONFIGS + gemm._FALLBACK_CONFIGS)
    # The first two rejected configs fit this budget but spill at unaligned sizes (tools/bench/kernel_audit.py).
    assert all(acc_regs(cfg) > 192 for cfg in gemm.SM90_REJECTED_CONFIGS[2:])
    assert all(cfg.kwargs["BLOCK_K"] == 128 for cfg in gemm.SM90_CONFIGS + gemm._FALLBACK_CONFIGS)


# ---- errors a caller can make ----

@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unsupported_combinations_raise(backend):
    a, b, sa, sb = _operands(8, 16, 256, E4M3, E4M3, GemmScaleMode.TENSORWISE, 0)
    _, _, ra, rb = _operands(8, 16, 256, E4M3, E4M3, GemmScaleMode.ROWWISE, 0)
    a, b, sa, sb, ra, rb = _to(DEVICE, a, b, sa, sb, ra, rb)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8_gemm(a.to(torch.float32).to(E5M2.dtype), b.to(torch.float32).to(E5M2.dtype), sa, sb, backend=backend)
    with pytest.raises(ValueError, match="unsupported scale shapes"):
        fp8_gemm(a, b, sa, rb, backend=backend)  # tensorwise A with rowwise B
    with pytest.raises(ValueError, match="unsupported scale shapes"):
        fp8_gemm(a, b, ra[:4], rb, backend=backend)
    with pytest.raises(ValueError, match="output dtype"):
        fp8_gemm(a, b, sa, sb, out_dtype=torch.float64, backend=backend)
    with pytest.raises(ValueError, match="same K"):
        fp8_gemm(a, b[:, :128], sa, sb, backend=backend)
    with pytest.raises(ValueError, match="accumulate=True needs `out`"):
        fp8_gemm(a, b, sa, sb, accumulate=True, backend=backend)
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8_gemm(a, b, sa, sb, bias=torch.zeros(3, device=DEVICE), backend=backend)
    with pytest.raises(ValueError, match="float32"):
        fp8_gemm(a, b, sa.double(), sb, backend=backend)


@pytest.mark.gpu
def test_compiled_kernel_and_dispatch_on_gpu_large_shapes():
    """Compiled Triton kernel (the default config; tuned under MEGAFP8_GEMM_AUTOTUNE=1) and the
    auto dispatch (torch._scaled_mm for tensorwise/rowwise) on 4096-sized GEMMs in every mode."""
    for mode in MODES:
        a, b, sa, sb = _operands(4096, 4096, 4096, E4M3, E4M3, mode, 1)
        expected = fp8_gemm_reference(a, b, sa, sb)
        for backend in ("triton", None):
            got = fp8_gemm(*_to("cuda", a, b, sa, sb), out_dtype=torch.bfloat16, backend=backend)
            assert sqnr_db(got.float().cpu(), expected) >= 40.0, (mode, backend)


@pytest.mark.parametrize("mode", [GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE], ids=lambda m: m.value)
def test_fast_accum_fprop_matches_reference(mode):
    """fast_accum=True (one accumulator over all of K, the path with a wgmma group in flight) against the fp32
    twin on an odd shape spanning several K steps and, in the interpreter, several persistent tiles per program."""
    a, b, sa, sb = _operands(129, 97, 700, E4M3, E4M3, mode, seed=7)
    bias = torch.randn(97, generator=torch.Generator().manual_seed(7))
    expected = fp8_gemm_reference(a, b, sa, sb, out_dtype=torch.float32, bias=bias)
    got = fp8_gemm(*_to(DEVICE, a, b, sa, sb), bias=_to(DEVICE, bias)[0], backend="triton", fast_accum=True)
    # The interpreter accumulates in fp32 exactly; Hopper's ~14-bit tensor-core accumulator is what the
    # 40 dB floor leaves room for on a GPU.
    assert sqnr_db(got.cpu(), expected) >= (40.0 if DEVICE == "cuda" else 50.0)


def test_fast_accum_refused_where_precision_is_needed():
    a, b, sa, sb = _operands(64, 64, 256, E4M3, E4M3, GemmScaleMode.BLOCKWISE, seed=3)
    with pytest.raises(ValueError, match="fast_accum=True is for tensorwise/rowwise"):
        fp8_gemm(a, b, sa, sb, fast_accum=True)
    a, b, sa, sb = _operands(64, 64, 256, E4M3, E4M3, GemmScaleMode.TENSORWISE, seed=3)
    with pytest.raises(ValueError, match="`out`/accumulate keep fp32 promotion"):
        fp8_gemm(a, b, sa, sb, out=torch.zeros(64, 64), accumulate=True, fast_accum=True)
