"""FP8 quantization: the Triton kernels equal their torch twin bit for bit, and the twin obeys the format.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); on a GPU
machine they run compiled on CUDA tensors. Either way the oracle is the reference twin on CPU.
"""
import itertools

import pytest
import torch

from fp8_testing import fp8_bits
from megafp8_kernels import E4M3, E5M2, Granularity, dequantize, quantize, scale_shape
from megafp8_kernels.quantize_reference import quantize_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [E4M3, E5M2]
GRANULARITIES = list(Granularity)
# Odd sizes on purpose: partial tiles, a single element, fewer rows than one block, more than one block.
SHAPES = [(1, 1), (3, 130), (130, 200), (257, 129)]


def _triton(x, fmt, gran, **kwargs):
    return quantize(x.to(DEVICE), fmt.dtype, gran, backend="triton", **kwargs)


def _assert_same(result, expected):
    """Bytes equal exactly; scales/amax equal exactly, NaN where the reference has NaN."""
    for name in ("data", "data_t"):
        got, want = getattr(result, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(fp8_bits(got.cpu()), fp8_bits(want)), f"{name}: FP8 bytes differ"
    for name in ("scale_inv", "amax", "scale_inv_t", "counts"):
        got, want = getattr(result, name), getattr(expected, name)
        if want is None:
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.stride() == want.stride(), f"{name}: layout {got.stride()} != {want.stride()}"
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True, msg=f"{name} differs")


def _input(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(8).exp2()  # rows of mixed magnitude
    if shape[0] > 5 and shape[1] > 7:
        x[3, 7] = 3e4  # outlier beyond E4M3's range before scaling
        x[5, :] = 0.0  # an all-zero row (amax 0)
    return x


@pytest.mark.parametrize("fmt,gran,pow2,transpose", list(itertools.product(FORMATS, GRANULARITIES, [False, True], [False, True])),
                         ids=lambda v: getattr(v, "value", None) or str(getattr(v, "dtype", v)))
def test_triton_equals_reference_bit_for_bit(fmt, gran, pow2, transpose):
    for i, shape in enumerate(SHAPES):
        x = _input(shape, seed=i)
        expected = quantize_reference(x, fmt.dtype, gran, power_of_2_scale=pow2, transpose=transpose)
        _assert_same(_triton(x, fmt, gran, power_of_2_scale=pow2, transpose=transpose), expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_given_scale_triton_equals_reference_and_returns_amax(fmt):
    """Delayed scaling: a given scale, saturation of values the scale pushes past the max, tensor amax out."""
    x = _input((150, 260), seed=7)
    scale = torch.tensor(fmt.max / 100.0)  # stale scale: everything above 100 saturates
    expected = quantize_reference(x, fmt.dtype, scale=scale, transpose=True)
    _assert_same(_triton(x, fmt, "tensorwise", scale=scale.to(DEVICE), transpose=True), expected)
    assert expected.amax.item() == x.abs().max().item()
    big = x.abs() > 100.0 * (1 + 2 ** -(fmt.mantissa_bits + 1))
    assert big.any()
    assert torch.all(expected.data.float()[big].abs() == fmt.max), "values past the max must saturate"


@pytest.mark.parametrize("gran", GRANULARITIES, ids=lambda g: g.value)
def test_input_dtypes_bf16_fp16(gran):
    for dtype in (torch.bfloat16, torch.float16):
        x = _input((70, 140), seed=3).clamp(-6e4, 6e4).to(dtype)
        _assert_same(_triton(x, E4M3, gran, transpose=True), quantize_reference(x, E4M3.dtype, gran, transpose=True))


# ---- multi-tile programs: each covers TILES_PER_PROGRAM consecutive K tiles, SLAB rows at a time ----

# Odd against every launch parameter: rows not a multiple of a slab or a tile (1, 130, 300, 513), K tiles not a
# multiple of TILES_PER_PROGRAM (643: 6 tiles, programs of 4 + 2), a single element.
MULTI_TILE_SHAPES = [(1, 1), (130, 257), (300, 70), (513, 129), (37, 643)]
KINDS = GRANULARITIES + ["given"]  # "given": tensorwise with a given (delayed) scale


def _multi_tile_input(shape, seed, dtype):
    x = _input(shape, seed).to(dtype)
    rows, cols = shape
    # Planted after the cast: torch's vectorized fp32 -> bf16 turns NaN into a negative NaN, whose sign after
    # NaN * NaN (a poisoned group's scale) depends on the operand order; the scalar store writes +NaN.
    if rows == 513:  # NaN in the last program's last slab, inf in another group: the NaN wins the tensor amax
        x[512, 128] = float("nan")
        x[3, 5] = float("inf")
    if cols == 643:
        x[36, 600] = -float("inf")  # in the second program along K
    return x


def _check_kind(kind, x, fmt, transpose, stats):
    kwargs = dict(transpose=transpose, stats=stats)
    gran = "tensorwise" if kind == "given" else kind
    if kind == "given":
        kwargs["scale"] = torch.tensor(fmt.max / 50.0)  # stale: the outliers saturate
    expected = quantize_reference(x, fmt.dtype, gran, **kwargs)
    if "scale" in kwargs:
        kwargs["scale"] = kwargs["scale"].to(DEVICE)
    _assert_same(_triton(x, fmt, gran, **kwargs), expected)
    return expected


# By default every kind with both outputs and the counters (the most code), and tensorwise in every combination; the
# rest with -m slow (CI time: each program runs in Triton's interpreter).
@pytest.mark.parametrize("kind,transpose,stats", [
    pytest.param(k, t, st, id=f"{getattr(k, 'value', k)}-{t}-{st}",
                 marks=[] if (t and st) or getattr(k, "value", k) == "tensorwise" else [pytest.mark.slow])
    for k, t, st in itertools.product(KINDS, [False, True], [False, True])])
def test_multi_tile_programs_equal_reference_bit_for_bit(kind, transpose, stats):
    """data, data_t, scale_inv(_t), amax and counts equal the twin's, fp32 and bf16 inputs, E4M3 and E5M2."""
    for i, shape in enumerate(MULTI_TILE_SHAPES):
        for dtype, fmt in ((torch.float32, E4M3), (torch.bfloat16, E5M2)):
            expected = _check_kind(kind, _multi_tile_input(shape, i, dtype), fmt, transpose, stats)
            if shape == (513, 129) and kind in ("tensorwise", "given"):
                assert torch.isnan(expected.amax), "the planted NaN must win the tensor amax"


@pytest.mark.parametrize("tiles,slab,slab_t", [(1, 128, 128), (3, 64, 32)])
def test_bits_do_not_depend_on_the_launch_parameters(monkeypatch, tiles, slab, slab_t):
    """One tile per program held whole (the pre-multi-tile launch), and 3 tiles per program in 64/32-row slabs,
    give the twin's bits too: the program split and the slab loop change only the order of exact reductions."""
    from megafp8_kernels import quantize_triton as Q

    monkeypatch.setattr(Q, "TILES_PER_PROGRAM", tiles)
    monkeypatch.setattr(Q, "SLAB", slab)
    monkeypatch.setattr(Q, "SLAB_TRANSPOSED", slab_t)
    for kind in KINDS:
        for transpose in (False, True):
            _check_kind(kind, _multi_tile_input((130, 643), 1, torch.float32), E4M3, transpose, stats=True)


# ---- the reference twin against the format itself (independent of both implementations) ----

@pytest.mark.parametrize("fmt,gran", list(itertools.product(FORMATS, GRANULARITIES)), ids=str)
def test_reference_round_trip_error_within_half_ulp(fmt, gran):
    """Each nonzero group's amax maps to exactly FP8_MAX, and every normal value is within half an FP8 ulp."""
    x = _input((130, 300), seed=11).double()
    q = quantize_reference(x.float(), fmt.dtype, gran)
    assert tuple(q.scale_inv.shape) == scale_shape(130, 300, gran)
    restored = dequantize(q.data, q.scale_inv, gran).double()
    scaled = x.abs() / dequantize(torch.ones_like(q.data.float()).to(fmt.dtype), q.scale_inv, gran).double()
    normal = scaled >= 2.0 ** fmt.min_normal_exponent
    rel_err = ((restored - x).abs() / x.abs())[normal]
    assert rel_err.max().item() <= 2.0 ** -(fmt.mantissa_bits + 1) * (1 + 1e-6)
    group_max = q.data.float().abs().amax()
    assert group_max.item() == fmt.max


def test_zero_groups_get_scale_one():
    x = torch.zeros(130, 256)
    x[:, 128:] = torch.randn(130, 128)
    for gran in (Granularity.TENSORWISE, Granularity.BLOCK_1X128, Granularity.BLOCK_128X128):
        q = _triton(torch.zeros(4, 4), E4M3, gran)
        assert torch.all(q.scale_inv.cpu() == 1.0) and torch.all(q.data.cpu().float() == 0.0)
    q = _triton(x, E4M3, Granularity.BLOCK_1X128)
    assert torch.all(q.scale_inv[:, 0].cpu() == 1.0)
    assert torch.all(torch.isfinite(q.scale_inv)) and torch.all(q.amax[:, 0].cpu() == 0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("gran", GRANULARITIES, ids=lambda g: g.value)
def test_non_finite_input_poisons_its_group_never_hidden(bad, gran):
    """A NaN/inf makes its group's scale NaN, so the whole group dequantizes to NaN; other groups survive."""
    x = _input((256, 256), seed=5)
    x[200, 200] = bad
    for q in (quantize_reference(x, E4M3.dtype, gran), _triton(x, E4M3, gran)):
        restored = dequantize(q.data.cpu(), q.scale_inv.cpu(), gran)
        assert torch.isnan(restored[200, 200])
        if gran is not Granularity.TENSORWISE:
            assert torch.isfinite(restored[0, 0]), "a group without NaN/inf must stay finite"
    if bad != bad:
        assert torch.isnan(quantize_reference(x, E4M3.dtype, gran).data.float()[200, 200])


def test_given_scale_nan_and_inf_become_nan_finite_overflow_saturates():
    """Delayed scaling: a finite value past the range saturates, but NaN and inf come out NaN. (Clamping
    an inf to FP8_MAX, as TE's satfinite cast does, would let an overflow pass unseen.)"""
    x = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf"), 1e9, -1e9, -0.0]])
    for fmt in FORMATS:
        q = _triton(x, fmt, "tensorwise", scale=torch.tensor(1.0, device=DEVICE))
        _assert_same(q, quantize_reference(x, fmt.dtype, scale=torch.tensor(1.0)))
        got = q.data.cpu().float()
        assert torch.isnan(got[0, 1]) and torch.isnan(got[0, 2]) and torch.isnan(got[0, 3])
        assert got[0, 4] == fmt.max and got[0, 5] == -fmt.max
        assert fp8_bits(q.data.cpu())[0, 6] == 0x80, "negative zero keeps its sign"
        assert torch.isnan(q.amax.cpu()), "the amax fed to the scale history must show the NaN"


def test_tiny_amax_gives_finite_scale_and_subnormals_round_correctly():
    x = torch.tensor([[1e-40, -3e-41, 0.0, 2e-42]])  # fp32 subnormals: 448/amax overflows to inf
    for gran in GRANULARITIES:
        q = _triton(x, E4M3, gran)
        assert torch.all(torch.isfinite(q.scale_inv.cpu())) and torch.all(q.scale_inv.cpu() > 0)
        _assert_same(q, quantize_reference(x, E4M3.dtype, gran))
    sub = torch.linspace(-2 ** -6, 2 ** -6, 1001).view(7, 143)  # E4M3 subnormal range with scale 1
    for fmt in FORMATS:
        _assert_same(_triton(sub, fmt, "tensorwise", scale=torch.tensor(1.0, device=DEVICE)),
                     quantize_reference(sub, fmt.dtype, scale=torch.tensor(1.0)))


def test_power_of_two_scales_are_powers_of_two():
    x = _input((130, 300), seed=2)
    for gran in GRANULARITIES:
        s = _triton(x, E4M3, gran, power_of_2_scale=True).scale_inv.cpu()
        mantissa, _ = torch.frexp(s)
        assert torch.all(mantissa == 0.5), gran


def test_block_1x128_scales_are_k_block_major():
    """1x128 scales keep their logical (rows, K/128) shape but are stored (K/128, rows): a GEMM's K step
    reads one contiguous scale vector. Both backends, both copies; amax shares the layout."""
    x = _input((300, 260), seed=4)
    for q in (quantize_reference(x, E4M3.dtype, "block_1x128", transpose=True),
              _triton(x, E4M3, "block_1x128", transpose=True)):
        assert q.scale_inv.shape == (300, 3) and q.scale_inv.stride() == (1, 300)
        assert q.amax.shape == (300, 3) and q.amax.stride() == (1, 300)
        assert q.scale_inv_t.shape == (260, 3) and q.scale_inv_t.stride() == (1, 260)
        # the same numbers as the row-major computation of each group's scale
        groups = torch.nn.functional.pad(x, (0, 124)).view(300, 3, 128).abs().amax(dim=2)
        assert torch.equal(q.amax.cpu(), groups)


def test_transposed_copy_is_the_quantized_transpose():
    """data_t is x.T quantized in its own K-major groups (tensorwise/128x128: the same bytes, moved)."""
    x = _input((200, 300), seed=9)
    for gran in GRANULARITIES:
        q = _triton(x, E4M3, gran, transpose=True)
        of_transpose = quantize_reference(x.t().contiguous(), E4M3.dtype, gran)
        assert torch.equal(fp8_bits(q.data_t.cpu()), fp8_bits(of_transpose.data)), gran
        torch.testing.assert_close(q.scale_inv_t.cpu(), of_transpose.scale_inv, rtol=0, atol=0)
        if gran in (Granularity.TENSORWISE, Granularity.BLOCK_128X128):
            assert torch.equal(fp8_bits(q.data_t.cpu()), fp8_bits(q.data.cpu()).t())


# ---- errors a caller can make ----

@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_arguments_raise_clear_errors(backend):
    x = torch.randn(4, 8, device=DEVICE if backend == "triton" else "cpu")
    with pytest.raises(ValueError, match="2-D"):
        quantize(x.view(2, 2, 8), E4M3.dtype, backend=backend)
    with pytest.raises(ValueError, match="unsupported FP8 dtype"):
        quantize(x, torch.float16, backend=backend)
    with pytest.raises(ValueError, match="unknown scaling granularity"):
        quantize(x, E4M3.dtype, "columnwise", backend=backend)
    with pytest.raises(ValueError, match="only supported with tensorwise"):
        quantize(x, E4M3.dtype, "rowwise", scale=torch.tensor(1.0, device=x.device), backend=backend)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        quantize(x.int(), E4M3.dtype, backend=backend)
    with pytest.raises(ValueError, match="empty"):
        quantize(x[:0], E4M3.dtype, backend=backend)


def test_package_quantize_stays_the_function_after_triton_runs():
    """The Triton submodule is imported lazily; were it named `quantize`, that import would overwrite
    the package attribute and `megafp8_kernels.quantize(...)` would fail with 'module is not callable'."""
    import megafp8_kernels

    _triton(torch.ones(2, 2), E4M3, "tensorwise")
    assert callable(megafp8_kernels.quantize) and megafp8_kernels.quantize is quantize


def test_backend_selection(monkeypatch):
    from megafp8_kernels import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend(cpu) == "reference"
    assert resolve_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("MEGAFP8_KERNEL_BACKEND", "reference")
    assert resolve_backend(torch.device("cuda")) == "reference"
    monkeypatch.setenv("MEGAFP8_KERNEL_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="MEGAFP8_KERNEL_BACKEND"):
        resolve_backend(cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend(cpu, "triton")


@pytest.mark.parametrize("gran", list(Granularity))
@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_op_of_a_transposed_view_matches_its_fake(gran, transpose):
    """A compiled graph may hand the quantize op a transposed view: its outputs stay row-major and separate, as the
    op's fake promises (inductor asserts the strides; a 3D --compile run with blockwise failed on it), with the bits
    of quantizing the same values laid out contiguously."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(128, 256).t()  # (256, 128), strides (1, 256)
    real = torch.ops.megafp8.quantize(x, torch.float8_e4m3fn, gran.value, False, None, transpose, "", False)
    with FakeTensorMode() as mode:
        fake = torch.ops.megafp8.quantize(mode.from_tensor(x), torch.float8_e4m3fn, gran.value, False, None,
                                          transpose, "", False)
    contiguous = torch.ops.megafp8.quantize(x.contiguous(), torch.float8_e4m3fn, gran.value, False, None,
                                            transpose, "", False)
    for got, promised, expected in zip(real, fake, contiguous):
        assert got.shape == promised.shape and (got.numel() <= 1 or got.stride() == promised.stride())
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           expected.view(torch.uint8) if expected.dtype.itemsize == 1 else expected)
