"""The quantizer's stats output (saturated / flushed counts of the cast): Triton (interpreter on CPU) equals the
twin exactly for every granularity, format, transpose and scaling kind; both equal telemetry's elementwise
definition computed in fp64; the op with stats=True passes torch.library.opcheck."""
import itertools

import pytest
import torch
from torch.library import opcheck

from megafp8_kernels import E4M3, E5M2, Granularity, expand_scale, quantize
from megafp8_kernels.quantize_reference import quantize_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 130), (130, 200), (257, 129)]


def _planted(shape, seed: int) -> torch.Tensor:
    """Rows of mixed magnitude, with outliers (saturate under a stale scale), zeros, and tiny values (flush)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    x = torch.randn(shape, generator=g) * torch.rand(rows, 1, generator=g).mul(6).exp2()
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)
    n = max(1, flat.numel() // 50)
    flat[picks[:n]] *= 300.0  # outliers
    flat[picks[n:2 * n]] = 0.0  # zeros: never flushed
    flat[picks[2 * n:3 * n]] *= 1e-7  # tiny: flushed to zero by any scale a group's amax allows
    if rows > 2:
        x[2] = 0.0  # an all-zero row (amax 0, scale 1)
    return x


def _cases():
    for fmt, gran, transpose in itertools.product([E4M3, E5M2], list(Granularity), [False, True]):
        yield fmt, gran, transpose, False
        if gran is Granularity.TENSORWISE:
            yield fmt, gran, transpose, True  # a given (delayed) scale


def _stale_scale(x: torch.Tensor, fmt) -> torch.Tensor:
    """A delayed scale from an amax 20x below the tensor's: its outliers saturate."""
    return torch.tensor(fmt.max / (x.abs().amax().item() / 20.0), dtype=torch.float32)


@pytest.mark.parametrize("fmt,gran,transpose,delayed", list(_cases()),
                         ids=lambda v: getattr(v, "value", None) or str(getattr(v, "dtype", v)))
def test_triton_counts_equal_the_twin(fmt, gran, transpose, delayed):
    for seed, shape in enumerate(SHAPES):
        x = _planted(shape, seed)
        scale = _stale_scale(x, fmt) if delayed else None
        want = quantize_reference(x, fmt.dtype, gran, scale=scale, transpose=transpose, stats=True)
        got = quantize(x.to(DEVICE), fmt.dtype, gran, scale=None if scale is None else scale.to(DEVICE),
                       transpose=transpose, stats=True, backend="triton")
        assert got.counts.dtype == torch.int64 and got.counts.shape == (2,)
        assert torch.equal(got.counts.cpu(), want.counts), (shape, got.counts, want.counts)
        assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    if delayed:
        assert want.counts[0] > 0  # the stale scale did saturate something
    assert want.counts[1] > 0  # and the tiny values flushed


def _fp64_counts(x: torch.Tensor, q, fmt, gran) -> tuple[int, int]:
    """Telemetry's elementwise definitions, in fp64: |x| past the clip level threshold * scale_inv of its
    group, and nonzero x whose FP8 value is +-0."""
    rows, cols = x.shape
    scale_inv = q.scale_inv.double()
    if gran in (Granularity.BLOCK_1X128, Granularity.BLOCK_128X128):
        scale_inv = expand_scale(scale_inv, rows, cols, gran)
    saturated = (x.double().abs() > fmt.saturation_threshold * scale_inv).sum()
    flushed = ((x != 0) & (q.data.double() == 0)).sum()
    return int(saturated), int(flushed)


@pytest.mark.parametrize("gran", list(Granularity), ids=lambda g: g.value)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_counts_match_the_elementwise_definition_in_fp64(fmt, gran):
    for seed in range(3):
        x = _planted((300, 260), 100 + seed)
        scales = [None, _stale_scale(x, fmt)] if gran is Granularity.TENSORWISE else [None]
        for scale in scales:
            q = quantize_reference(x, fmt.dtype, gran, scale=scale, stats=True)
            assert tuple(q.counts.tolist()) == _fp64_counts(x, q, fmt, gran)


def test_counts_edge_values():
    """Exactly at the thresholds: 464 (E4M3) rounds to 448, just above it clips; half the smallest subnormal
    rounds to the even 0 (flushed), just above it to the subnormal; NaN and inf inputs."""
    one = torch.ones((), dtype=torch.float32)
    half_sub = E4M3.flush_threshold
    x = torch.tensor([[464.0, 464.0 * (1 + 2 ** -20), half_sub, half_sub * (1 + 2 ** -20), 0.0, float("inf"),
                       float("nan"), -500.0]])
    want = (3, 1)  # 464(1+eps), inf, -500 saturate; only half_sub flushes
    for backend in ("reference", "triton"):
        q = quantize(x.to(DEVICE), E4M3.dtype, scale=one.to(DEVICE), stats=True, backend=backend)
        assert tuple(q.counts.tolist()) == want, backend


def test_stats_op_passes_opcheck():
    x = _planted((130, 200), 7)
    for backend in ("", "triton"):
        opcheck(torch.ops.megafp8.quantize.default,
                (x.to(DEVICE), torch.float8_e4m3fn, "block_1x128", False, None, True, backend, True))
        opcheck(torch.ops.megafp8.quantize.default,
                (x.to(DEVICE), torch.float8_e5m2, "tensorwise", False, torch.tensor(3.0, device=DEVICE), False,
                 backend, True))
    assert quantize(x, torch.float8_e4m3fn).counts is None  # stats are opt-in


@pytest.mark.parametrize("case", ["tensorwise", "rowwise", "given scale"])
def test_atomic_amax_keeps_nan_where_torch_amax_has_it(case):
    """The amax passes MAX the tiles' amaxes atomically on their int32 bits: a NaN in one tile (and one column,
    for the rowwise transposed copy) still reaches the tensor's / its row's / its column's amax and scale."""
    x = _planted((257, 300), 11)
    x[200, 260] = float("nan")
    gran = "tensorwise" if case == "given scale" else case
    scale = torch.tensor(2.0) if case == "given scale" else None
    want = quantize_reference(x, E4M3.dtype, gran, scale=scale, transpose=True)
    got = quantize(x.to(DEVICE), E4M3.dtype, gran, scale=None if scale is None else scale.to(DEVICE), transpose=True,
                   backend="triton")
    for name in ("amax", "scale_inv", "scale_inv_t"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got.amax.cpu()).any()
