"""The fused RMSNorm -> FP8 and SwiGLU -> FP8 Triton kernels against their reference twins (Triton's interpreter on
CPU, set by conftest.py; the GPU on a CUDA machine): bf16 activations give the same bits (bytes, transposed
bytes, scales, amax); fp32 ones the same bytes up to the prologue's own fp32 rounding (the row sum's order, exp),
which moves a value across an FP8 rounding boundary rarely. Shapes are odd (partial tiles in both dims)."""
import pytest
import torch

from megafp8_kernels import rmsnorm_quantize, swiglu_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("tensorwise", 5.0), ("block_1x128", None), ("tensorwise", None), ("rowwise", None)]  # last two: two passes


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(130, 260, generator=g) * 3).to(dtype)
    weight = torch.rand(260, generator=g) + 0.5
    gate_up = (torch.randn(130, 520, generator=g) * 2).to(dtype)
    channel_scale = torch.exp2(torch.randint(-3, 4, (260,), generator=g).float())
    return [t.to(DEVICE) for t in (x, weight, gate_up, channel_scale)]


def _both(fn):
    return fn("triton"), fn("reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gran, scale", CASES, ids=[f"{g}-{'given' if s else 'current'}" for g, s in CASES])
@pytest.mark.parametrize("prologue", ["rmsnorm", "swiglu", "smooth_swiglu"])
def test_fused_quantize_kernel_matches_its_twin(prologue, gran, scale, dtype):
    x, weight, gate_up, channel_scale = _inputs(dtype)
    kw = dict(scale=None if scale is None else torch.tensor(scale, device=DEVICE), transpose=True)
    fp8 = torch.float8_e4m3fn
    if prologue == "rmsnorm":
        (fused, rstd), (ref, ref_rstd) = _both(lambda b: rmsnorm_quantize(x, weight, 1e-5, fp8, gran, backend=b, **kw))
        torch.testing.assert_close(rstd, ref_rstd, rtol=4e-7, atol=0)  # a few fp32 ulps: the row sum's order
    else:
        s = channel_scale if prologue == "smooth_swiglu" else None
        fused, ref = _both(lambda b: swiglu_quantize(gate_up, s, fp8, gran, backend=b, **kw))
    pairs = [(fused.data, ref.data), (fused.data_t, ref.data_t)]
    if dtype == torch.bfloat16:  # the fp32 ulps vanish in the bf16 rounding of the prologue's output
        for a, b in pairs:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in ((fused.scale_inv, ref.scale_inv), (fused.scale_inv_t, ref.scale_inv_t), (fused.amax, ref.amax)):
            assert torch.equal(a, b)
    else:
        for a, b in pairs:
            assert (a.view(torch.uint8) == b.view(torch.uint8)).float().mean() >= 0.999
        for a, b in ((fused.scale_inv, ref.scale_inv), (fused.scale_inv_t, ref.scale_inv_t), (fused.amax, ref.amax)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def _outlier_inputs():
    """bf16 (so the kernel's values are the twin's exactly) with planted outliers (saturate under the given scale),
    tiny values (flush to zero) and exact zeros (neither), in partial tiles of both dims."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 200, generator=g)
    x[3, 7], x[40, 150], x[69, 199] = 1000.0, -800.0, 900.0  # normalized to ~sqrt(200): past 464 / 64
    x[5, :20], x[6, 130:] = 1e-5, 0.0
    gate_up = torch.randn(70, 400, generator=g)
    gate_up[1, 3], gate_up[1, 203] = 12.0, 40.0  # silu(12) * 40: past 464 / 64
    gate_up[60, 230:260], gate_up[61, 300:] = 1e-6, 0.0  # up tiny / zero
    weight = torch.rand(200, generator=g) + 0.5
    channel_scale = torch.exp2(torch.randint(-3, 4, (200,), generator=g).float())
    return [t.to(DEVICE) for t in (x.to(torch.bfloat16), weight, gate_up.to(torch.bfloat16), channel_scale)]


@pytest.mark.parametrize("gran, scale", [("tensorwise", 64.0), ("block_1x128", None), ("rowwise", None)],
                         ids=["given", "block_1x128", "rowwise-two-pass"])
@pytest.mark.parametrize("prologue", ["rmsnorm", "swiglu", "smooth_swiglu"])
def test_fused_quantize_counts_match_the_twin(prologue, gran, scale):
    """stats=True: the kernel's two atomics per tile count what the twin's cast_counts does (saturated, flushed)."""
    x, weight, gate_up, channel_scale = _outlier_inputs()
    kw = dict(scale=None if scale is None else torch.tensor(scale, device=DEVICE), transpose=True, stats=True)
    fp8 = torch.float8_e4m3fn
    if prologue == "rmsnorm":
        fused, ref = (q for q, _ in _both(lambda b: rmsnorm_quantize(x, weight, 1e-5, fp8, gran, backend=b, **kw)))
    else:
        s = channel_scale if prologue == "smooth_swiglu" else None
        fused, ref = _both(lambda b: swiglu_quantize(gate_up, s, fp8, gran, backend=b, **kw))
    assert fused.counts.dtype == torch.int64 and torch.equal(fused.counts, ref.counts), (fused.counts, ref.counts)
    assert ref.counts[1] > 0 and (ref.counts[0] > 0) == (scale is not None)  # current scaling never saturates
    assert torch.equal(fused.data.view(torch.uint8), ref.data.view(torch.uint8))


@pytest.mark.parametrize("stats", [False, True])
def test_fused_ops_pass_opcheck(stats):
    """The fakes (torch.compile's view) match the real outputs, the counts output included."""
    x, weight, gate_up, _ = _outlier_inputs()
    for args in ((x, weight, 1e-5), (gate_up, None)):
        op = torch.ops.megafp8.rmsnorm_quantize if len(args) == 3 else torch.ops.megafp8.swiglu_quantize
        for gran, scale in (("tensorwise", torch.tensor(64.0, device=DEVICE)), ("block_1x128", None)):
            torch.library.opcheck(op.default, (*args, torch.float8_e4m3fn, gran, False, scale, True, "", stats))
