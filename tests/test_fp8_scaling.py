"""Delayed scaling: the update formula, the history roll, max vs most_recent, the amax 0/inf/NaN cases,
and the once-per-step amax all-reduce across 2 real gloo ranks."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megafp8.fp8 import Fp8Linear, Fp8Recipe, Fp8ScalingManager, ScalingState
from megafp8.fp8.scaling_state import update_scales

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _state(**recipe_kw):
    recipe = Fp8Recipe(**recipe_kw)
    return ScalingState(recipe, torch.float8_e4m3fn)


def _step(state, amax):
    state.observe(torch.tensor(amax))
    update_scales([state], torch.stack([state.pending_amax]))


def test_formula_and_margin():
    """scale = FP8_MAX / amax / 2**margin (TransformerEngine), computed from the history."""
    s = _state(amax_history_len=4, margin=0)
    _step(s, 3.5)
    assert s.scale.item() == pytest.approx(E4M3_MAX / 3.5, rel=1e-7)
    s2 = _state(amax_history_len=4, margin=2)
    _step(s2, 3.5)
    assert s2.scale.item() == pytest.approx(E4M3_MAX / 3.5 / 4, rel=1e-7)
    e5 = ScalingState(Fp8Recipe(amax_history_len=2), torch.float8_e5m2)
    _step(e5, 2.0)
    assert e5.scale.item() == E5M2_MAX / 2.0


def test_history_roll_and_compute_algo():
    """The history holds the last L step amaxes, newest first; `max` uses all, `most_recent` the newest."""
    by_max, by_recent = _state(amax_history_len=3), _state(amax_history_len=3, amax_compute_algo="most_recent")
    for amax in (8.0, 2.0, 1.0, 0.5):
        _step(by_max, amax)
        _step(by_recent, amax)
    assert by_max.amax_history.tolist() == [0.5, 1.0, 2.0]  # 8.0 rolled out after 3 newer steps
    assert by_max.scale.item() == pytest.approx(E4M3_MAX / 2.0)
    assert by_recent.scale.item() == pytest.approx(E4M3_MAX / 0.5)


def test_micro_batch_amaxes_fold_into_the_step_max():
    s = _state(amax_history_len=2)
    for amax in (1.0, 7.0, 3.0):  # three micro-batches
        s.observe(torch.tensor(amax))
    update_scales([s], torch.stack([s.pending_amax]))
    assert s.amax_history[0].item() == 7.0 and s.pending_amax.item() == 0.0


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_zero_or_non_finite_amax_keeps_previous_scale(bad):
    s = _state(amax_history_len=1, amax_compute_algo="most_recent")
    _step(s, 4.0)
    before = s.scale.item()
    _step(s, bad)
    assert s.scale.item() == before
    _step(s, 2.0)  # the bad step must not pin later updates
    assert s.scale.item() == pytest.approx(E4M3_MAX / 2.0)


def test_non_finite_amax_does_not_poison_a_max_history():
    s = _state(amax_history_len=8)
    _step(s, 4.0)
    _step(s, float("nan"))
    assert torch.isfinite(s.amax_history).all()
    assert s.scale.item() == pytest.approx(E4M3_MAX / 4.0)


def test_power_of_two_scale_rounds_down():
    s = _state(amax_history_len=1, power_of_2_scale=True)
    _step(s, 3.0)  # 448 / 3 = 149.3 -> 128
    assert s.scale.item() == 128.0


def test_scaling_state_is_in_the_state_dict():
    layer = Fp8Linear(8, 8, recipe=Fp8Recipe(amax_history_len=5))
    keys = set(layer.state_dict())
    for role in ("input", "weight", "grad_output"):
        assert f"fp8_scaling.{role}.amax_history" in keys and f"fp8_scaling.{role}.scale" in keys
    assert layer.state_dict()["fp8_scaling.input.amax_history"].shape == (5,)


# ---- one all-reduce per step across ranks ----

def _amax_worker(rank: int, world: int, init_file: str, results: dict):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        model = torch.nn.Sequential(Fp8Linear(32, 64, recipe=Fp8Recipe()), Fp8Linear(64, 16, recipe=Fp8Recipe()))
        calls = []

        def counting_all_reduce_max(tensor, group):
            calls.append(tensor.numel())
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

        manager = Fp8ScalingManager(model, reduce_group=dist.group.WORLD, all_reduce_max=counting_all_reduce_max)
        for step in range(2):
            for micro in range(3):
                x = torch.randn(8, 32) * (1 + 10 * rank) * (micro + 1)  # ranks see different amaxes
                model(x).square().sum().backward()
            manager.update()
        scales = torch.stack([s.scale for s in manager.states()])
        gathered = [torch.empty_like(scales) for _ in range(world)]
        dist.all_gather(gathered, scales)
        results[rank] = {"calls": calls, "scales": [g.tolist() for g in gathered],
                         "input_amax": model[0].fp8_scaling["input"].amax_history[0].item()}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_amax_reduction_is_one_collective_per_step_and_scales_agree():
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_amax_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        # 2 steps -> 2 collectives, each carrying all 6 states (2 layers x input/weight/grad_output).
        assert results[rank]["calls"] == [6, 6]
        assert results[rank]["scales"][0] == results[rank]["scales"][1], "ranks must end with identical scales"
    assert results[0]["input_amax"] == results[1]["input_amax"]
