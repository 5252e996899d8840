"""fp16 master weights with stochastic rounding: the rounding itself against numpy's float16 grid (a neighbour
always, unbiased on average, exact values kept), its counter-based uniforms (independent of chunking), and a
small LM trained 200 steps at lr 1e-4 and 3e-5 against torch.optim.AdamW in fp32: RMSNorm gains (which start
at 1.0, the bottom of a binade, where round-to-nearest never moves them) and matrix weights move like AdamW's,
and the final loss is within 0.2%. Plus: the rounding does not depend on chunking or storage layout, DP=2
equals DP=1, and a run resumed from a state dict is bit-identical to the uninterrupted run."""
import copy

import numpy as np
import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import build, make_ddp, reference_adamw, tiny_config, train_step
from megafp8.optim import DistributedOptimizer
from megafp8.optim.stochastic_rounding import counter_uniform, stochastic_round_to_fp16
from megafp8.parallel.parallel_state import ParallelState


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's float16 grid: the largest fp16 <= x and the smallest fp16 >= x (fp64 values)."""
    nearest = x.astype(np.float16)
    lo = np.where(nearest.astype(np.float64) <= x, nearest, np.nextafter(nearest, np.float16(-np.inf)))
    hi = np.where(nearest.astype(np.float64) >= x, nearest, np.nextafter(nearest, np.float16(np.inf)))
    return lo.astype(np.float64), hi.astype(np.float64)


# Code values (value x scale) an AdamW step produces: a norm gain at 1.0 (code 1024, the bottom of a binade,
# grid 1 above and 0.5 below) moved by lr 1e-4 / 3e-5 either way, large and small elements, subnormals.
CASES = [1024 + 0.1024, 1024 - 0.1024, 1024 + 0.0307, 1024 - 0.0307, 1500.3, -1500.3, 3.3e-3, 6.1e-6, -2.5e-8, 40000.7]


@pytest.mark.parametrize("x", CASES)
def test_stochastic_rounding_is_a_neighbour_and_unbiased(x):
    n = 1 << 16
    values = torch.full((n,), x, dtype=torch.float32)
    rounded = stochastic_round_to_fp16(values, counter_uniform(12345, 0, n))
    assert rounded.dtype == torch.float16
    exact = float(values[0])  # the fp32 value the encode sees
    lo, hi = (float(v[0]) for v in _neighbours(np.array([exact])))
    got = rounded.double().numpy()
    assert set(np.unique(got)) <= {lo, hi}
    p_up = (exact - lo) / (hi - lo)
    sigma = (hi - lo) * np.sqrt(p_up * (1 - p_up) / n)
    assert abs(got.mean() - exact) <= 5 * sigma + 1e-12 * abs(exact), (got.mean(), exact, sigma)
    # Round-to-nearest, for contrast, is biased by the whole rounding error at these values.
    assert abs(float(values[0].half()) - exact) > 20 * sigma


def test_stochastic_rounding_keeps_exact_values_and_extremes():
    exact = torch.tensor([0.0, -0.0, 1.0, 1024.0, 65504.0, -65504.0, 2.0 ** -24, 3.0 * 2 ** -20])
    assert torch.equal(stochastic_round_to_fp16(exact, torch.full_like(exact, 0.999)).float(), exact)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e6, -70000.0])
    out = stochastic_round_to_fp16(special, torch.full_like(special, 0.5)).float()
    assert out[0] == float("inf") and out[1] == -float("inf") and torch.isnan(out[2])
    assert out[3] == 65504.0 and out[4] == -65504.0  # finite values beyond fp16 saturate


def test_counter_uniform_does_not_depend_on_chunking():
    whole = counter_uniform(7, 0, 4096)
    assert torch.equal(whole[1000:3000], counter_uniform(7, 1000, 2000))
    assert not torch.equal(whole, counter_uniform(8, 0, 4096))
    assert 0.0 <= float(whole.min()) and float(whole.max()) < 1.0
    counts = torch.histc(counter_uniform(3, 2 ** 33, 1 << 16), bins=16, min=0.0, max=1.0)
    expected = (1 << 16) / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 45.0  # chi-square, 15 dof: p ~ 1e-4


# ---- a small LM, 200 steps at small learning rates -------------------------------------------------------
LM = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, seq_length=16, vocab_size=128)
STEPS = 200


def _noisy_bigram_batch(cfg, seed: int, n: int = 8):
    """Next token = (5 t + 3) mod V with probability 0.7, else uniform."""
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.vocab_size
    seq = torch.empty(n, cfg.seq_length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(cfg.seq_length):
        follow = torch.rand(n, generator=g) < 0.7
        seq[:, t + 1] = torch.where(follow, (5 * seq[:, t] + 3) % vocab, torch.randint(0, vocab, (n,), generator=g))
    return seq[:, :-1], seq[:, 1:]


def _train(lr: float, master: str | None):
    """(initial params, final params, held-out loss); master None = torch.optim.AdamW in fp32."""
    cfg = tiny_config(**LM)
    model = build(cfg, ParallelState().init_process_groups())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    if master is None:
        opt = reference_adamw(model, lr, weight_decay=0.0)
    else:
        opt = DistributedOptimizer(make_ddp(model, ParallelState().init_process_groups()), master_weight_dtype=master)
    for step in range(STEPS):
        ids, labels = _noisy_bigram_batch(cfg, step)
        opt.zero_grad()
        model(ids, labels).mean().backward()
        if master is None:
            opt.step()
        else:
            assert not opt.step(lr).skipped
    with torch.no_grad():
        loss = float(model(*_noisy_bigram_batch(cfg, 10 ** 6, 64)).mean())
    return initial, {n: p.detach().clone() for n, p in model.named_parameters()}, loss


def _slope(moved: torch.Tensor, reference: torch.Tensor) -> float:
    """Least-squares slope of our displacements on AdamW's: 1 = unbiased, < 1 = stalled (rounded away)."""
    return float((moved.double() * reference.double()).sum() / reference.double().square().sum())


@pytest.mark.parametrize("lr", [pytest.param(1e-4, marks=pytest.mark.slow), 3e-5])  # 3e-5: the harder case
def test_fp16_master_moves_like_adamw_at_small_lr(lr):
    initial, ref, ref_loss = _train(lr, None)
    initial_ours, ours, loss = _train(lr, "fp16")
    gains = [n for n in initial if "norm" in n]
    assert gains and all(torch.equal(initial[n], torch.ones_like(initial[n])) for n in gains)
    assert all(torch.equal(initial[n], initial_ours[n]) for n in initial)
    gain0 = torch.cat([initial[n] for n in gains])
    gain_ref, gain_ours = torch.cat([ref[n] for n in gains]) - gain0, torch.cat([ours[n] for n in gains]) - gain0
    # Share of gains that grew (AdamW: 62% at 1e-4, 73% at 3e-5; round-to-nearest: 0%; measured within 1.6 points).
    assert abs(float((gain_ours > 0).double().mean()) - float((gain_ref > 0).double().mean())) <= 0.05
    # Mean displacement (AdamW: 1.27e-2 at 1e-4, 3.17e-3 at 3e-5; round-to-nearest: 0; measured within 1.4%).
    assert abs(float(gain_ours.mean()) - float(gain_ref.mean())) <= 0.05 * abs(float(gain_ref.mean()))
    assert 0.95 <= _slope(gain_ours, gain_ref) <= 1.05  # measured 1.007, 1.025
    matrices = [n for n in initial if initial[n].dim() >= 2]
    moved = torch.cat([(ours[n] - initial[n]).flatten() for n in matrices])
    moved_ref = torch.cat([(ref[n] - initial[n]).flatten() for n in matrices])
    assert 0.98 <= _slope(moved, moved_ref) <= 1.02  # measured 1.000, 1.000
    # The largest 1% of each matrix (the coarsest fp16 grid relative to the step): no stall either.
    top = [initial[n].abs().flatten() >= initial[n].abs().flatten().quantile(0.99) for n in matrices]
    big = torch.cat([(ours[n] - initial[n]).flatten()[t] for n, t in zip(matrices, top)])
    big_ref = torch.cat([(ref[n] - initial[n]).flatten()[t] for n, t in zip(matrices, top)])
    assert 0.95 <= _slope(big, big_ref) <= 1.05  # measured 1.000, 1.002 (round-to-nearest at 3e-5: 0.89)
    assert abs(loss - ref_loss) <= 0.002 * ref_loss, (loss, ref_loss)  # measured within 0.01%


# ---- layout independence and resume -----------------------------------------------------------------------
LR, WD = 3e-4, 0.1


def _fp16_run(ps, steps: int, bucket_size=2000, chunk_size=1 << 16, states="fp8", distributed=True, sequences=None):
    cfg = tiny_config()
    model = build(cfg, ps)
    ddp = make_ddp(model, ps, use_distributed_optimizer=distributed, bucket_size=bucket_size)
    opt = DistributedOptimizer(ddp, weight_decay=WD, master_weight_dtype="fp16", optimizer_state_dtype=states,
                               chunk_size=chunk_size)
    losses = [train_step(ddp, opt, cfg, step, LR, sequences=sequences)[1] for step in range(steps)]
    ddp.finish_param_sync()
    return cfg, ddp, opt, losses


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_rounding_does_not_depend_on_chunks_or_buckets():
    """Each element's rounding is keyed by its index in its own parameter, not by where the rank stores it."""
    _, a, _, _ = _fp16_run(ParallelState().init_process_groups(), 2)
    _, b, _, _ = _fp16_run(ParallelState().init_process_groups(), 2, bucket_size=700, chunk_size=128)
    for name, value in _params(a.module).items():
        assert torch.equal(value, _params(b.module)[name]), name


def _dp2_body(rank, world_size):
    run = dict(steps=4, states="fp32", sequences=8)
    _, ddp, _, _ = _fp16_run(ParallelState(world_size=world_size).init_process_groups(), **run)
    _, single, _, _ = _fp16_run(ParallelState().init_process_groups(), distributed=False, **run)
    # The same global batch: only the fp32 grad reduction order differs, which can flip a rounding decision
    # only where the uniform falls within that difference of the rounding threshold.
    got, expected = _params(ddp.module), _params(single.module)
    differing = sum(int((got[n] != expected[n]).sum()) for n in got)
    assert differing <= 0.001 * sum(v.numel() for v in got.values()), differing
    for name in got:
        grid = torch.exp2(torch.floor(torch.log2(expected[name].abs().clamp(min=1e-30))) - 10)  # fp16 grid at x
        assert torch.all((got[name] - expected[name]).abs() <= 2 * grid + 1e-7), name


@pytest.mark.distributed
def test_dp2_equals_dp1():
    run_distributed(_dp2_body, world_size=2, timeout_s=600)


def test_resume_from_state_dict_is_bit_exact():
    cfg, ddp, opt, _ = _fp16_run(ParallelState().init_process_groups(), 3)
    saved = copy.deepcopy(opt.state_dict())
    continued = [train_step(ddp, opt, cfg, step, LR)[1] for step in (3, 4, 5)]
    ddp.finish_param_sync()
    ps = ParallelState().init_process_groups()
    model = build(cfg, ps, seed=123)  # other weights: the optimizer state must bring everything back
    ddp2 = make_ddp(model, ps, use_distributed_optimizer=True, bucket_size=700)
    opt2 = DistributedOptimizer(ddp2, weight_decay=WD, master_weight_dtype="fp16", optimizer_state_dtype="fp8")
    opt2.load_state_dict(saved)
    resumed = [train_step(ddp2, opt2, cfg, step, LR)[1] for step in (3, 4, 5)]
    ddp2.finish_param_sync()
    assert resumed == continued
    for name, value in _params(ddp.module).items():
        assert torch.equal(value, _params(ddp2.module)[name]), name
