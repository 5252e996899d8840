"""The saturation guard's strikes live on the device: the same decisions as the old guard that read every
check on the host (a Python re-implementation of it is the oracle), no host read between read iterations, a
constant number of ops per check whatever the number of layers, and a save between reads keeps its switch."""
import pytest
import torch
from torch import nn

from op_counting import OpCounter
from megafp8.fp8 import Fp8Linear, Fp8Recipe, SaturationGuard
from megafp8.fp8.telemetry import Fp8TensorStats

ROLES = ("input", "weight", "grad_output")
NUMEL = 1000


def _model(layers: int) -> nn.Sequential:
    return nn.Sequential(*[Fp8Linear(8, 8, recipe=Fp8Recipe.tensorwise()) for _ in range(layers)])


def _saturated_counts(layers: int, iterations: int, seed: int) -> torch.Tensor:
    """[iteration, layer, role] saturated counts out of NUMEL: mostly under a 1% threshold, with bursts over
    it of 1 to 4 iterations, some exactly at 10 (= the threshold, not over it)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 8, (iterations, layers, len(ROLES)), generator=g)
    burst = torch.rand(iterations, layers, generator=g) < 0.3
    counts[..., 0] += burst * torch.randint(0, 30, (iterations, layers), generator=g)
    counts[torch.rand(iterations, layers, len(ROLES), generator=g) < 0.05] = 10
    return counts


def _record(model: nn.Module, counts: torch.Tensor, device: str = "cpu") -> None:
    for layer, module in enumerate(model):
        if not module.runs_high_precision:
            module.fp8_telemetry = {role: Fp8TensorStats(torch.ones(()), torch.ones(()), torch.stack(
                [counts[layer, r], torch.tensor(0)]).to(device), NUMEL) for r, role in enumerate(ROLES)}


def _old_guard(counts: torch.Tensor, threshold: float, patience: int) -> list[tuple[int, str, float]]:
    """The guard as it was: every check reads each layer's worst float32 fraction and switches at once."""
    strikes, switched, events = {}, set(), []
    for iteration, step in enumerate(counts, start=1):
        for layer, per_role in enumerate(step):
            name = str(layer)
            if name in switched:
                continue
            fraction = max(float((c / NUMEL).float()) for c in per_role)
            strikes[name] = strikes.get(name, 0) + 1 if fraction > threshold else 0
            if strikes[name] >= patience:
                switched.add(name)
                events.append((iteration, name, fraction))
    return events


@pytest.mark.parametrize("read_interval", [1, 4, 7])
@pytest.mark.parametrize("patience", [1, 3])
def test_same_decisions_as_the_host_guard_that_read_every_check(read_interval, patience):
    layers, iterations = 6, 40
    for seed in range(3):
        counts = _saturated_counts(layers, iterations, seed)
        model = _model(layers)
        guard = SaturationGuard(threshold=0.01, patience=patience, read_interval=read_interval)
        for iteration in range(1, iterations + 1):
            _record(model, counts[iteration - 1])
            events_before = len(guard.events)
            messages = guard.check(model, iteration)
            assert len(messages) == len(guard.events) - events_before
            assert not messages or iteration % read_interval == 0
            if read_interval == 1:  # the switch lands at the check that trips, as before
                assert all(e["iteration"] == iteration for e in guard.events[events_before:])
        guard.state_dict()  # settles the last trips (a save is a read point)
        got = sorted((e["iteration"], e["layer"], e["saturated"]) for e in guard.take_events())  # read in layer order
        want = _old_guard(counts, 0.01, patience)
        assert want and got == want, (seed, got, want)
        assert {str(i) for i, m in enumerate(model) if m.guard_high_precision} == {name for _, name, _ in want}


def _check_ops(layers: int, monkeypatch) -> int:
    """aten ops of one non-read check after the first (which builds the device state); fails on a host read."""
    model = _model(layers)
    guard = SaturationGuard(read_interval=10)
    counts = _saturated_counts(layers, 3, 0)
    _record(model, counts[0])
    guard.check(model, 1)
    _record(model, counts[1])
    tolists = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolists.append(1) or [])
    with OpCounter() as counter:
        assert guard.check(model, 2) == []
    monkeypatch.undo()
    assert counter.host_reads == 0 and not tolists
    return counter.ops


def test_a_check_between_reads_has_no_host_read_and_constant_ops(monkeypatch):
    few, many = _check_ops(2, monkeypatch), _check_ops(12, monkeypatch)
    assert few == many <= 20, (few, many)  # the whole check: 18 ops measured


def test_a_save_between_reads_switches_the_tripped_layer_and_a_reload_keeps_it():
    model = _model(3)
    guard = SaturationGuard(patience=2, read_interval=100)
    over = torch.zeros(3, len(ROLES), dtype=torch.int64)
    over[1, 2] = 500  # layer 1's output gradient: 50% saturated
    for iteration in (1, 2, 3):
        _record(model, over)
        assert guard.check(model, iteration) == []  # tripped at 2, nothing read yet
    assert not model[1].guard_high_precision
    state = guard.state_dict()
    assert state["switched"] == ["1"] and state["strikes"] == {"0": 0, "1": 2, "2": 0}
    assert model[1].guard_high_precision and guard.take_events() == [{"iteration": 2, "layer": "1", "saturated": 0.5}]
    fresh, resumed = _model(3), SaturationGuard(patience=2, read_interval=100)
    resumed.load_state_dict(state, fresh)
    assert fresh[1].guard_high_precision and not fresh[0].guard_high_precision
    _record(fresh, over)
    assert resumed.check(fresh, 4) == [] and resumed.state_dict()["switched"] == ["1"]


def test_a_trip_after_the_last_read_is_not_lost_at_the_end_of_a_run():
    model = _model(2)
    guard = SaturationGuard(patience=1, read_interval=10)
    over = torch.zeros(2, len(ROLES), dtype=torch.int64)
    over[0, 0] = 500
    _record(model, over)
    assert guard.check(model, 3) == []  # 3 is not a read iteration
    assert guard.take_events() == [{"iteration": 3, "layer": "0", "saturated": 0.5}] and model[0].guard_high_precision


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)  # cuda: pinned host flags, non-blocking copies, events
@pytest.mark.parametrize("switch_lag", [1, 2])
@pytest.mark.parametrize("patience", [1, 3])
def test_a_lagged_switch_lands_lag_checks_after_the_trip_with_the_same_decisions(switch_lag, patience, device):
    """switch_lag (the trainer's 1): between read iterations a trip is switched exactly `switch_lag` checks after
    it, reading one host flag per check; the decisions stay the old guard's."""
    layers, iterations, read_interval = 6, 40, 100
    for seed in range(3):
        counts = _saturated_counts(layers, iterations, seed)
        model = _model(layers)
        guard = SaturationGuard(threshold=0.01, patience=patience, read_interval=read_interval, switch_lag=switch_lag)
        want = _old_guard(counts, 0.01, patience)
        for iteration in range(1, iterations + 1):
            _record(model, counts[iteration - 1], device)
            events_before = len(guard.events)
            messages = guard.check(model, iteration)
            assert len(messages) == len(guard.events) - events_before
            # A layer tripped switch_lag checks ago is switched by now; a check that switches reads every trip so far.
            switched = {e["layer"] for e in guard.events}
            assert {name for at, name, _ in want if at <= iteration - switch_lag} <= switched, iteration
            new = [e["iteration"] for e in guard.events[events_before:]]
            assert not new or (max(new) <= iteration and min(new) <= iteration - switch_lag), (iteration, new)
            assert all(f"(applied at iteration {iteration})" in m for m, at in zip(messages, new) if at < iteration)
        guard.state_dict()
        got = sorted((e["iteration"], e["layer"], e["saturated"]) for e in guard.take_events())
        assert want and got == want, (seed, got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_lagged_check_reads_no_device_value_until_a_layer_trips(monkeypatch, device):
    model = _model(3)
    guard = SaturationGuard(patience=2, read_interval=100, switch_lag=1)
    under, over = torch.zeros(3, len(ROLES), dtype=torch.int64), torch.zeros(3, len(ROLES), dtype=torch.int64)
    over[2, 0] = 500
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self, _t=torch.Tensor.tolist: reads.append(1) or _t(self))
    for iteration, counts in enumerate([under, under, over, over], start=1):  # trips at 4
        _record(model, counts, device)
        with OpCounter() as counter:
            assert guard.check(model, iteration) == []
        assert counter.host_reads == 0 and not reads, iteration
        assert iteration == 1 or counter.ops <= 21, counter.ops  # the check (18) + the flag: any(), copy_ (1: setup)
    _record(model, under, device)
    messages = guard.check(model, 5)  # the flag of check 4 is set: this check reads the strikes and switches
    assert model[2].guard_high_precision and reads == [1]
    assert messages == ["fp8 guard: 2 saturated 50.00% > 1.00% for 2 checks at iteration 4: switched to high "
                        "precision (applied at iteration 5)"]
