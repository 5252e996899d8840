"""Smooth-SwiGLU (same function, better FC2-input quantization), FP8 telemetry and its guard."""
import copy

import pytest
import torch
import torch.nn.functional as F

from fp8_testing import sqnr_db
from megafp8.fp8 import (
    Float8Tensor,
    Fp8Linear,
    Fp8Recipe,
    Fp8ScalingManager,
    SaturationGuard,
    collect_fp8_telemetry,
    enable_fp8_telemetry,
    invalidate_fp8_weight_caches,
    smooth_swiglu_channel_scales,
    swiglu,
)
from megafp8_kernels import Granularity, quantize


def _swiglu_activations(tokens=256, ffn=512, outlier_channel=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(tokens, ffn, generator=g), torch.randn(tokens, ffn, generator=g)
    # The late-training failure mode (Fishman et al.): one channel whose gate and up weights aligned, so
    # its SwiGLU output grows quadratically (here 10^4 x the others).
    gate[:, outlier_channel] *= 100.0
    up[:, outlier_channel] *= 100.0
    return swiglu(gate, up)


def test_smooth_swiglu_is_identical_to_swiglu_in_high_precision():
    """Power-of-two channel scales fold out exactly: the FC2 output is bit-identical, gradients too."""
    h = _swiglu_activations()
    fc2 = Fp8Linear(512, 128)  # no recipe, no autocast: high precision
    s = smooth_swiglu_channel_scales(h)
    assert torch.all(torch.frexp(s).mantissa == 0.5), "scales must be powers of two"
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    plain, smooth = fc2(h1), fc2(h2, input_channel_scale=s)
    assert torch.equal(plain, smooth)
    plain.square().sum().backward()
    grad_plain = fc2.weight.grad.clone()
    fc2.weight.grad = None
    smooth.square().sum().backward()
    torch.testing.assert_close(fc2.weight.grad, grad_plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_smooth_swiglu_improves_fc2_input_quantization(scaling):
    """With an outlier channel, FP8 of h*s (then / s) is closer to h than FP8 of h itself.

    Measured per channel: a whole-tensor SQNR is dominated by the outlier channel's energy and hides
    what the outlier does to the others (their values sink into E4M3's subnormals or flush to zero).
    """
    h = _swiglu_activations()
    s = smooth_swiglu_channel_scales(h)

    def fp8_round_trip(t):
        q = quantize(t, torch.float8_e4m3fn, Granularity.TENSORWISE)
        return Float8Tensor.from_quantized(q, Granularity.TENSORWISE).dequantize()

    def per_channel_sqnr_db(approx, ref):
        noise = (approx.double() - ref.double()).pow(2).mean(0)
        return 10 * torch.log10(ref.double().pow(2).mean(0) / noise)

    plain = per_channel_sqnr_db(fp8_round_trip(h), h)
    smooth = per_channel_sqnr_db(fp8_round_trip(h * s) / s, h)
    assert smooth.mean() > plain.mean() + 3.0, (plain.mean(), smooth.mean())
    assert smooth.min() > plain.min() + 3.0, "the worst channel must gain the most"
    # The outlier channel itself may give up about one binade of headroom (~3 dB), no more.
    assert smooth[17] >= plain[17] - 3.5

    # Through the layer (separate layers with the same weights, so delayed states do not mix): the
    # output is dominated by the outlier channel's term, which both keep precise, so it stays close;
    # folding 1/s into W's columns moves range into the weight, which can cost it a little.
    torch.manual_seed(1)
    plain_fc2 = Fp8Linear(512, 128, recipe=Fp8Recipe(scaling=scaling, amax_history_len=4))
    smooth_fc2 = copy.deepcopy(plain_fc2)
    exact = h.double() @ plain_fc2.weight.detach().double().t() + plain_fc2.bias.detach().double()
    if scaling == "delayed":
        plain_fc2(h), smooth_fc2(h, input_channel_scale=s)
        Fp8ScalingManager(plain_fc2, None).update(), Fp8ScalingManager(smooth_fc2, None).update()
    with torch.no_grad():
        plain_db, smooth_db = sqnr_db(plain_fc2(h), exact), sqnr_db(smooth_fc2(h, input_channel_scale=s), exact)
    assert smooth_db >= 25.0 and smooth_db >= plain_db - 2.5, (plain_db, smooth_db)


def test_telemetry_reports_saturation_and_flush_and_guard_switches_layer():
    layer = Fp8Linear(64, 32, recipe=Fp8Recipe.delayed(amax_history_len=1))
    # One step with input amax 448 sets the delayed input scale to 448 / 448 = 1 (a cold layer would use
    # current scaling); then inputs beyond 448 saturate, inputs below E4M3's smallest subnormal flush.
    layer(torch.full((16, 64), 448.0)).sum().backward()
    Fp8ScalingManager(layer, None).update()
    invalidate_fp8_weight_caches(layer)  # as the optimizer step does
    enable_fp8_telemetry(layer)
    x = torch.ones(16, 64)
    x[:, :8] = 1000.0  # 1/8 of the elements saturate
    x[:, 8:12] = 1e-4  # 1/16 flush to zero (E4M3 subnormals stop at 2**-9)
    layer(x).sum().backward()
    stats = collect_fp8_telemetry(layer)
    assert stats["fp8//input/saturated"] == pytest.approx(1 / 8)
    assert stats["fp8//input/flushed_to_zero"] == pytest.approx(1 / 16)
    assert stats["fp8//input/amax"] == 1000.0 and stats["fp8//input/scale"] == 1.0
    assert {"fp8//weight/amax", "fp8//grad_output/saturated"} <= set(stats)

    guard = SaturationGuard(threshold=0.01, patience=2)
    assert guard.check(layer, iteration=1) == []
    messages = guard.check(layer, iteration=2)
    assert len(messages) == 1 and "switched to high precision" in messages[0] and "iteration 2" in messages[0]
    assert layer.guard_high_precision and layer.runs_high_precision
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), "a switched layer runs in high precision"


def test_telemetry_is_off_by_default():
    layer = Fp8Linear(16, 16, recipe=Fp8Recipe.tensorwise())
    layer(torch.randn(4, 16))
    assert collect_fp8_telemetry(layer) == {}


def test_telemetry_does_not_count_rounding_as_saturation():
    """A group's own amax maps onto FP8_MAX: rounded, not clipped. Gaussian data must report 0 saturated,
    and the guard (default threshold) must leave a blockwise layer in FP8."""
    torch.manual_seed(0)
    for recipe in (Fp8Recipe.blockwise(), Fp8Recipe.rowwise(), Fp8Recipe.tensorwise()):
        layer = Fp8Linear(256, 256, recipe=recipe)
        enable_fp8_telemetry(layer)
        guard = SaturationGuard()
        for _ in range(4):
            layer(torch.randn(128, 256)).sum().backward()
            assert guard.check(layer) == []
        stats = collect_fp8_telemetry(layer)
        assert all(v == 0.0 for k, v in stats.items() if k.endswith("saturated")), (recipe.scaling, stats)
        assert not layer.runs_high_precision


def test_guard_decides_on_the_reduced_saturation_and_the_switch_survives_a_reload():
    """With all_reduce_max, a rank that saw no saturation still switches when a peer did (all ranks agree);
    the guard's state dict restores the switch in a resumed model."""
    model = torch.nn.Sequential(Fp8Linear(64, 32, recipe=Fp8Recipe.tensorwise()))
    enable_fp8_telemetry(model)
    model(torch.randn(16, 64)).sum().backward()

    def peer_saw_saturation(fractions):  # stands in for a MAX all-reduce where another rank saturated
        fractions.clamp_(min=0.5)

    guard = SaturationGuard(threshold=0.01, patience=1, all_reduce_max=peer_saw_saturation)
    assert len(guard.check(model)) == 1 and model[0].guard_high_precision
    assert guard.state_dict()["switched"] == ["0"]
    resumed = torch.nn.Sequential(Fp8Linear(64, 32, recipe=Fp8Recipe.tensorwise()))
    SaturationGuard().load_state_dict(guard.state_dict(), resumed)
    assert resumed[0].runs_high_precision
    with pytest.raises(KeyError, match="does not have"):
        SaturationGuard().load_state_dict({"switched": ["7"]}, resumed)


def test_smooth_swiglu_scales_stay_finite_for_near_zero_channels():
    h = torch.randn(8, 4)
    h[:, 1] = 2.0 ** -130  # silu far into its negative side: fp32 subnormals
    h[:, 2] = 0.0
    s = smooth_swiglu_channel_scales(h)
    assert torch.isfinite(s).all() and s[2] == 1.0 and s[1] == 2.0 ** 64
    fc2 = Fp8Linear(4, 3, recipe=Fp8Recipe.tensorwise())
    assert torch.isfinite(fc2(h, input_channel_scale=s)).all()


def test_delayed_scaling_does_not_hide_an_inf():
    """An inf in the input of a delayed-scaling layer must reach the output as NaN, not as FP8_MAX."""
    layer = Fp8Linear(8, 4, recipe=Fp8Recipe.delayed(amax_history_len=2))
    layer(torch.ones(2, 8))  # one step so the layer runs on its delayed scale (a cold one scales currently)
    Fp8ScalingManager(layer, None).update()
    x = torch.ones(2, 8)
    x[0, 3] = float("inf")
    y = layer(x)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


def test_scaling_state_stays_fp32_under_model_casts():
    layer = Fp8Linear(8, 8, recipe=Fp8Recipe.delayed(amax_history_len=3)).bfloat16()
    assert layer.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for n, b in layer.named_buffers() if "fp8_scaling" in n)
    layer(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()  # runs, scales usable


@pytest.mark.parametrize("gran", list(Granularity), ids=lambda g: g.value)
def test_recorded_statistics_equal_the_whole_tensor_formula(gran):
    """Telemetry reads the quantizer's own counts (no second pass over the tensor): for a bf16 input with
    saturating, flushing and zero elements they give exactly the fractions of the elementwise formula in fp64."""
    from megafp8.fp8 import telemetry
    from megafp8_kernels import expand_scale

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 260, generator=g) * 2.0 ** torch.randint(-20, 12, (300, 260), generator=g)).bfloat16()
    x[::7, ::5] = 0.0
    scale = torch.tensor(0.5)  # a delayed-style scale too small for the outliers: some clip, some flush
    q = quantize(x.float(), torch.float8_e4m3fn, gran, scale=scale if gran is Granularity.TENSORWISE else None,
                 stats=True)
    fp8 = Float8Tensor.from_quantized(q, gran)
    layer = Fp8Linear(260, 4)
    telemetry.record_fp8_stats(layer, "input", fp8, q.counts, q.amax)
    stats = layer.fp8_telemetry["input"].values()

    x64 = x.double()
    clip = telemetry.saturation_threshold(torch.float8_e4m3fn) * expand_scale(fp8.scale_inv.double(), 300, 260, gran)
    saturated = (x64.abs() > clip).double().mean().item()
    flushed = ((x64 != 0) & (fp8.data.double() == 0)).double().mean().item()
    assert stats["saturated"].item() == pytest.approx(saturated, rel=1e-6)
    assert stats["flushed_to_zero"].item() == pytest.approx(flushed, rel=1e-6) and flushed > 0
    if gran is Granularity.TENSORWISE:
        assert saturated > 0
