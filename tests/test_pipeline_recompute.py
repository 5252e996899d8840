"""Activation recomputation changes no bit: gradients and the delayed-scaling state after each step equal the
run without recomputation exactly (fp32 and FP8 delayed), randomness inside a recomputed region is replayed,
and bad recompute flags fail naming the flag. Recomputation inside pipeline schedules (ZBV's split B / W
passes, interleaved FP8) is compared with PP=1 in tests/test_pipeline.py."""
import pytest
import torch

from megafp8.fp8 import Fp8Recipe, invalidate_fp8_weight_caches
from megafp8.model import ModelConfig
from megafp8.model.recompute import recompute, recomputed_layer_groups
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.parallel.random import model_parallel_seed

RECOMPUTE = {
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def _run(recompute_flags: dict, fp8: bool, steps: int = 3):
    cfg = ModelConfig(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=8,
                      vocab_size=60, make_vocab_size_divisible_by=4, **recompute_flags)
    recipe = Fp8Recipe.delayed(amax_history_len=4) if fp8 else None
    pipe = build_pipeline(cfg, ParallelState().init_process_groups(), micro_batch_size=2, num_microbatches=2,
                          fp8_recipe=recipe)
    g = torch.Generator().manual_seed(4)
    history = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length), generator=g)
        loss = pipe.step(ids, ids.roll(-1, dims=1))
        grads = {name: p.grad.clone() for name, p in pipe.named_parameters()}
        scaling = {k: v.clone() for k, v in pipe.state_dict().items() if ".fp8_scaling." in k}
        history.append((loss.detach(), grads, scaling))
        with torch.no_grad():
            for p in pipe.parameters():
                p.sub_(0.5 * p.grad)
                p.grad = None
        invalidate_fp8_weight_caches(pipe.modules)
    return history


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-delayed"])
def test_recompute_is_bit_identical(fp8):
    baseline = _run({}, fp8)
    assert not fp8 or baseline[0][2], "the FP8 run must have delayed-scaling state to compare"
    for name, flags in RECOMPUTE.items():
        for step, ((loss, grads, scaling), (ref_loss, ref_grads, ref_scaling)) in enumerate(zip(_run(flags, fp8), baseline)):
            assert torch.equal(loss, ref_loss), (name, step)
            for key in ref_grads:
                assert torch.equal(grads[key], ref_grads[key]), (name, step, key)
            assert scaling.keys() == ref_scaling.keys()
            for key in ref_scaling:  # no second amax folded, same scales
                assert torch.equal(scaling[key], ref_scaling[key]), (name, step, key)


def test_recomputed_region_replays_its_randomness():
    """Default generator and the model-parallel RNG's forked stream: the recomputed forward must draw
    the same numbers, so the gradient equals the noise the forward used."""
    rng = model_parallel_seed(3, tp_rank=1)
    seen = []

    def noisy(x: torch.Tensor) -> torch.Tensor:
        a = torch.rand_like(x)
        with rng.fork():
            b = torch.rand_like(x)
        seen.append((a, b))
        return x * a + x * b

    x = torch.ones(16, requires_grad=True)
    recompute(noisy, x, rng=rng).sum().backward()
    assert len(seen) == 2, "forward + recomputed forward"
    (a, b), (a2, b2) = seen
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert torch.equal(x.grad, a + b)


def test_layer_groups_follow_megatron():
    assert recomputed_layer_groups(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recomputed_layer_groups(5, "block", 2) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert recomputed_layer_groups(2, "block", 4) == [(0, 1, True), (1, 2, True)]


@pytest.mark.parametrize("flags, message", [
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
    (dict(recompute_granularity="selective", recompute_method="block"), "--recompute-granularity full only"),
    (dict(recompute_granularity="everything"), "--recompute-granularity must be one of"),
    (dict(recompute_num_layers=2), "need --recompute-granularity full"),
])
def test_bad_recompute_flags_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**flags)
