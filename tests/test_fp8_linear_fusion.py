"""Fused RMSNorm -> FP8 and SwiGLU -> FP8 prologues: a transformer layer with them equals the unfused layer bit for
bit (outputs, input and parameter gradients, delayed-scaling state) for every recipe, at TP=1 and at TP=2 with and
without sequence parallelism; the fused kernels' twins equal the unfused math; RMSNorm's written-out backward
agrees with fp64 autograd; and the kernel launches per layer stay within the budget of issue 19 (at TP=1, and under
TP=2 + SP, where the fused kernels now serve the sequence shard's cast too)."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from distributed_testing import run_distributed
from megafp8.fp8 import Fp8Recipe, Fp8ScalingManager, collect_fp8_telemetry, enable_fp8_telemetry, fp8_autocast
from megafp8.fp8.telemetry import SaturationGuard
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.sharding import shard_state_dict
from megafp8.parallel.tensor_parallel import allreduce_sequence_parallel_grads
from megafp8_kernels import (
    quantize,
    rms_norm_backward_reference,
    rms_norm_forward_reference,
    rmsnorm_quantize,
    swiglu_quantize,
    swiglu_reference,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import bench_layer_kernels  # noqa: E402

RECIPES = {
    "delayed": Fp8Recipe.delayed(amax_history_len=4),
    "tensorwise": Fp8Recipe.tensorwise(),
    "rowwise": Fp8Recipe.rowwise(),
    "blockwise": Fp8Recipe.blockwise(),
    "blockwise_hybrid_pow2": Fp8Recipe.blockwise(fp8_format="hybrid", power_of_2_scale=True),
}


def _layer(activation: str = "swiglu", params_dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      seq_length=16, activation=activation, params_dtype=params_dtype)
    model = GPTModel(cfg, ParallelState().init_process_groups())
    return model.layers["0"], model.rotary(16)


def _steps(layer, rotary, recipe, fused: bool, steps: int = 3, dtype=torch.float32, telemetry_at: int = -1,
           guard: SaturationGuard | None = None):
    """Per step: output, input grad, parameter grads and every buffer (scaling state) after the update; with a
    guard (telemetry on every step, as a default FP8 run) also the recorded telemetry, its counts and the guard's
    strikes after its check."""
    layer = copy.deepcopy(layer)
    layer.fuse_fp8_prologues = fused
    manager = Fp8ScalingManager(layer, None)
    results = []
    for step in range(steps):
        enable_fp8_telemetry(layer, guard is not None or step == telemetry_at)
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(16, 2, 128, generator=g) * (1 + 4 * step)).to(dtype).requires_grad_()
        with fp8_autocast(recipe=recipe):
            y = layer(x, rotary)
        y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view_as(y).to(y.dtype))
        if guard is not None:
            counts = {f"{name}/{role}": stats.counts.clone() for name, module in layer.named_modules()
                      for role, stats in getattr(module, "fp8_telemetry", {}).items()}
            guard.check(layer, step)
            results.append((collect_fp8_telemetry(layer), counts, dict(guard.strikes)))
        manager.update()
        results.append((y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()},
                        {n: b.clone() for n, b in layer.named_buffers()}))
        layer.zero_grad(set_to_none=True)
    return results


def _assert_bitwise_equal(unfused, fused, case):
    """Step records of tensors, dicts of them, telemetry floats and strikes: all equal, tensors bit for bit."""
    assert len(unfused) == len(fused)
    for step, (a, b) in enumerate(zip(unfused, fused)):
        assert len(a) == len(b)
        for item, (x, y) in enumerate(zip(a, b)):
            assert _equal(x, y), (case, step, item, [k for k in x if not _equal(x[k], y[k])] if isinstance(x, dict) else "")


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return x == y


@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_layer_equals_unfused_bit_for_bit(name):
    layer, rotary = _layer()
    _assert_bitwise_equal(_steps(layer, rotary, RECIPES[name], False), _steps(layer, rotary, RECIPES[name], True), name)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_layer_with_the_guard_equals_unfused_bit_for_bit(name):
    """Telemetry on every step (the default saturation guard): the fused kernels count the cast's saturated and
    flushed elements themselves, so the recorded telemetry, its counts and the guard's strikes (threshold 0: any
    saturated step is a strike) equal the unfused layer's, and so does everything else."""
    layer, rotary = _layer()
    runs = [_steps(layer, rotary, RECIPES[name], fused, guard=SaturationGuard(threshold=0.0, patience=100))
            for fused in (False, True)]
    _assert_bitwise_equal(*runs, name)
    telemetry = runs[1][-2][0]
    assert sum(1 for k in telemetry if k.endswith("/input/saturated")) == 4  # QKV, proj, FC1, FC2: all recorded
    if name == "delayed":  # the inputs grow 5x a step: the stale delayed scales saturate, and a strike follows
        assert any(v > 0 for k, v in telemetry.items() if k.endswith("/input/saturated"))
        assert max(runs[1][-2][2].values()) > 0


def test_fused_smooth_swiglu_bf16_and_telemetry_steps_equal_unfused():
    """Smooth-SwiGLU's channel scales, bf16 activations and parameters, and a step with telemetry on (fused too:
    the kernel counts the cast's saturated/flushed elements)."""
    layer, rotary = _layer("smooth_swiglu", torch.bfloat16)
    recipe = RECIPES["delayed"]
    unfused = _steps(layer, rotary, recipe, False, dtype=torch.bfloat16, telemetry_at=1)
    _assert_bitwise_equal(unfused, _steps(layer, rotary, recipe, True, dtype=torch.bfloat16, telemetry_at=1), "smooth")


def test_fused_path_runs_the_fused_kernels():
    layer, rotary = _layer()
    count = bench_layer_kernels.count_layer("delayed", fused=True)
    assert count["forward_ops"]["megafp8::rmsnorm_quantize"] == 2 and count["forward_ops"]["megafp8::swiglu_quantize"] == 1
    assert "aten::rsqrt" not in count["forward_ops"] and "aten::silu" not in count["forward_ops"]


@pytest.mark.parametrize("gran, scale", [("tensorwise", None), ("tensorwise", 3.0), ("rowwise", None),
                                         ("block_1x128", None)])
def test_fused_ops_equal_the_unfused_math(gran, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 200, generator=g) * 3
    weight = torch.rand(200, generator=g) + 0.5
    gate_up = torch.randn(70, 400, generator=g)
    channel_scale = torch.exp2(torch.randint(-3, 4, (200,), generator=g).float())
    kw = dict(scale=None if scale is None else torch.tensor(scale), transpose=True)
    normed, rstd = rms_norm_forward_reference(x, weight, 1e-5)
    cases = [(rmsnorm_quantize(x, weight, 1e-5, torch.float8_e4m3fn, gran, **kw)[0], normed),
             (swiglu_quantize(gate_up, channel_scale, torch.float8_e4m3fn, gran, **kw),
              swiglu_reference(*gate_up.chunk(2, dim=-1), channel_scale))]
    for fused, hp in cases:
        unfused = quantize(hp, torch.float8_e4m3fn, gran, **kw)
        for a, b in zip((fused.data, fused.data_t), (unfused.data, unfused.data_t)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(fused.scale_inv, unfused.scale_inv) and torch.equal(fused.scale_inv_t, unfused.scale_inv_t)
        assert torch.equal(fused.amax, unfused.amax)
    assert torch.equal(rmsnorm_quantize(x, weight, 1e-5, torch.float8_e4m3fn, gran, **kw)[1], rstd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_matches_fp64_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 96, generator=g) * 2).to(dtype)
    weight = (torch.rand(96, generator=g) + 0.5).to(dtype)
    grad = torch.randn(6, 5, 96, generator=g).to(dtype)
    y, rstd = rms_norm_forward_reference(x, weight, 1e-5)
    dx, dw = rms_norm_backward_reference(grad, x, weight, rstd)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    ref = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref.backward(grad.double())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), ref.detach(), **tol)
    torch.testing.assert_close(dx.double(), x64.grad, **tol)
    torch.testing.assert_close(dw.double(), w64.grad, **tol)
    assert dx.dtype == dtype and dw.dtype == dtype


# Launches per transformer layer, forward + backward (tools/bench/bench_layer_kernels.py; docs/benchmarks.md): before
# the fusion 111 delayed, 99 tensorwise/rowwise/blockwise, 132 delayed + Smooth-SwiGLU, 91 high precision.
LAUNCH_BUDGET = {"delayed": 89, "tensorwise": 77, "rowwise": 77, "blockwise": 77, "delayed + smooth_swiglu": 112,
                 "high precision": 81}


def test_layer_launches_within_budget_and_independent_of_size():
    for name, budget in LAUNCH_BUDGET.items():
        count = bench_layer_kernels.count_layer(name, fused=True)
        assert count["forward"] + count["backward"] <= budget, (name, count["forward"], count["backward"])
    small = bench_layer_kernels.count_layer("blockwise", fused=True, hidden=128, seq=32)
    large = bench_layer_kernels.count_layer("blockwise", fused=True, hidden=256, seq=160)
    assert small["forward_ops"] == large["forward_ops"] and small["backward_ops"] == large["backward_ops"]
    unfused = bench_layer_kernels.count_layer("blockwise", fused=False)
    assert unfused["forward"] - small["forward"] == 14  # 2 x (RMSNorm's 6 ops + its cast) + SwiGLU's 2, merged


@pytest.mark.parametrize("name", ["delayed", "blockwise", "delayed + smooth_swiglu"])
def test_layer_launches_with_telemetry_on_are_the_fused_ones(name):
    """A default FP8 run has telemetry on every step (the saturation guard): the casts count saturated/flushed
    elements inside the same custom ops, so the layer launches exactly what it does with telemetry off."""
    quiet = bench_layer_kernels.count_layer(name, fused=True)
    guarded = bench_layer_kernels.count_layer(name, fused=True, telemetry=True)
    assert guarded["forward_ops"] == quiet["forward_ops"] and guarded["backward_ops"] == quiet["backward_ops"]
    assert guarded["forward_ops"]["megafp8::rmsnorm_quantize"] == 2
    assert guarded["forward_ops"]["megafp8::swiglu_quantize"] == 1


# TP=2 cases: (recipe, sequence parallel, seq_length (batch 2), forced-overflow layer, RMSNorms of the 2-layer model
# fused per warm training step, and in a no-grad forward (no x^T)). Under SP a rank holds seq_length token rows:
# 128 (256: two 1x128 token groups per rank) when "aligned", else 16.
TP_CASES = {
    "no SP delayed": (RECIPES["delayed"], False, 16, None, 4, 4),
    "SP delayed": (RECIPES["delayed"], True, 16, None, 4, 4),
    "SP delayed, forced overflow": (RECIPES["delayed"], True, 16, "layers.0.self_attention.linear_qkv", 3, 3),
    "SP blockwise aligned": (RECIPES["blockwise"], True, 128, None, 4, 4),
    "SP blockwise_hybrid_pow2 aligned, 2 groups": (RECIPES["blockwise_hybrid_pow2"], True, 256, None, 4, 4),
    # x^T's 128-token / per-channel groups span both ranks; current tensorwise needs every rank's amax first.
    "SP blockwise unaligned": (RECIPES["blockwise"], True, 16, None, 0, 4),
    "SP rowwise": (RECIPES["rowwise"], True, 16, None, 0, 4),
    "SP tensorwise": (RECIPES["tensorwise"], True, 16, None, 0, 0),
}


PROLOGUE_OPS = ("megafp8::rmsnorm_quantize", "megafp8::swiglu_quantize", "aten::rsqrt")


def _tp_steps(ps, cfg, recipe, fused: bool, overflow: str | None, steps: int = 3):
    """A model built from scratch, trained `steps` steps with telemetry and the guard on every step (threshold 0:
    a saturated step is a strike). Per step: loss, every parameter gradient (norm weights included) and buffer
    (amax histories, scales) after the update, the recorded telemetry, its counts and the guard's strikes; and
    the forward's rmsnorm_quantize, swiglu_quantize and rsqrt ops; then the same of a no-grad forward."""
    torch.manual_seed(0)
    model = GPTModel(cfg, ps, fp8_recipe=recipe)
    for layer in model.layers.values():
        layer.fuse_fp8_prologues = fused
    if overflow is not None:
        model.get_submodule(overflow).forced_overflow_factor = 16.0
    enable_fp8_telemetry(model, True)
    guard = SaturationGuard(threshold=0.0, patience=100)
    manager = fp8_scaling_manager(model, ps)
    results, ops = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
        with bench_layer_kernels.LaunchCount() as forward:
            loss = model(ids, torch.roll(ids, 1, dims=1))
        loss.mean().backward()
        allreduce_sequence_parallel_grads(model, ps)
        counts = {f"{name}/{role}": stats.counts.clone() for name, module in model.named_modules()
                  for role, stats in getattr(module, "fp8_telemetry", {}).items()}
        guard.check(model, step)
        results.append((collect_fp8_telemetry(model), counts, dict(guard.strikes)))
        manager.update()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                        {n: b.clone() for n, b in model.named_buffers()}))
        ops.append(tuple(forward.launches[op] for op in PROLOGUE_OPS))
        model.zero_grad(set_to_none=True)
    with torch.no_grad(), bench_layer_kernels.LaunchCount() as forward:
        results.append((model(ids, torch.roll(ids, 1, dims=1)),))
    ops.append(tuple(forward.launches[op] for op in PROLOGUE_OPS))
    return results, ops


def _tp_body(rank: int, world_size: int) -> None:
    """TP=2 with and without SP: the fused model equals the unfused one bit for bit, and the fused kernels run
    where Quantizer.fuses_sequence_shard says they serve SP."""
    for case, (recipe, sp, seq, overflow, warm_norms, no_grad_norms) in TP_CASES.items():
        cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                          num_query_groups=4, seq_length=seq, vocab_size=100, make_vocab_size_divisible_by=8)
        ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                           sequence_parallel=sp).init_process_groups()
        (unfused, unfused_ops), (fused, fused_ops) = (_tp_steps(ps, cfg, recipe, f, overflow) for f in (False, True))
        _assert_bitwise_equal(unfused, fused, case)
        if overflow is not None:  # its clipped input strikes, recorded by the unfused cast in both runs
            assert fused[-3][2].get(overflow, 0) > 0, (case, fused[-3][2])
        for step, ((norms, swiglus, rsqrts), (unfused_norms, unfused_swiglus, unfused_rsqrts)) in enumerate(
                zip(fused_ops, unfused_ops)):
            cold = recipe.is_delayed and step == 0  # a cold state of a TP-sharded cast needs the whole amax first
            expected = (0, 0) if cold else (no_grad_norms if step == len(fused_ops) - 1 else warm_norms, 2)
            assert (norms, swiglus) == expected, (case, step, norms, swiglus)
            # The high-precision norm output is never computed: one rsqrt less per fused norm.
            assert unfused_norms == unfused_swiglus == 0 and rsqrts == unfused_rsqrts - norms, (case, step)


@pytest.mark.distributed
def test_tp2_fused_equals_unfused_with_and_without_sequence_parallel():
    run_distributed(_tp_body, world_size=2)


def test_fused_norms_still_run_their_module_hooks():
    """--overlap-param-gather waits for a weight's gather in its module's forward pre-hook: a fused norm is still
    called (as_prologue=True), so its hook runs (tests/test_optim_fp8_param_gather.py covers the gather itself)."""
    layer, rotary = _layer()
    called = []
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
        norm.register_forward_pre_hook(lambda module, args: called.append(module))
    with fp8_autocast(recipe=RECIPES["delayed"]):
        layer(torch.randn(16, 2, 128), rotary)
    assert called == [layer.input_layernorm, layer.pre_mlp_layernorm]


class _DroppingMaxComm:
    """Rank 0 of 2 whose MAX all-reduce is std::max(other, mine), as gloo's: a NaN of this rank's loses to 0."""

    size, rank = 2, 0

    def sync_amax(self, t: torch.Tensor) -> None:
        other = torch.zeros_like(t)
        t.copy_(torch.where(other < t, t, other))


def test_fused_transposed_shard_keeps_a_nan_scale_through_a_max_that_drops_nan():
    from types import SimpleNamespace

    from megafp8.fp8 import Fp8Recipe
    from megafp8_kernels import Granularity

    scale_t = torch.tensor([[0.5, float("nan")], [2.0, 1.0]])
    local = SimpleNamespace(granularity=Granularity.BLOCK_1X128, col_major=lambda: (torch.zeros(2, 256), scale_t))
    _, full, _ = Fp8Recipe.blockwise().quantizer("input").transposed_fused_shard(local, _DroppingMaxComm())
    assert full.shape == (2, 4) and torch.equal(full[:, 2:], torch.zeros(2, 2))
    assert torch.equal(full[:, :2].nan_to_num(-1.0), scale_t.nan_to_num(-1.0))  # the NaN group stays NaN
