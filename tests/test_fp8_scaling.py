"""Delayed scaling: the update against an fp64 reimplementation of TransformerEngine's rule, the formula,
history roll and amax edge cases, O(1) device ops per update whatever the layer count, the flat-buffer
views through casts / loads / a second manager, is_cold, tolerant loads (an HF checkpoint into a delayed
FP8 GPTModel), and the once-per-step amax all-reduce across 2 real gloo ranks."""
import copy
import math
import pickle
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_testing import run_distributed
from megafp8.fp8 import Fp8Linear, Fp8Recipe, Fp8ScalingManager, ScalingState
from megafp8.fp8.scaling_state import FRESH_STATE_WARNING

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FP32_MAX = torch.finfo(torch.float32).max


class _States(nn.Module):
    """A bag of ScalingStates, as a model holds them (nested modules, persistent buffers)."""

    def __init__(self, specs: list[tuple[Fp8Recipe, torch.dtype]]):
        super().__init__()
        self.states = nn.ModuleList(ScalingState(recipe, dtype) for recipe, dtype in specs)


def _single(**recipe_kw) -> tuple[ScalingState, Fp8ScalingManager]:
    holder = _States([(Fp8Recipe(**recipe_kw), torch.float8_e4m3fn)])
    return holder.states[0], Fp8ScalingManager(holder, None)


def _step(state, manager, amax):
    state.observe(torch.tensor(amax))
    manager.update()


# ---- the update rule against an fp64 reimplementation of TransformerEngine's ----

def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().item()


def _te_update(history: list[float], scale: float, step_amax: float, recipe: Fp8Recipe, fp8_max: float):
    """TransformerEngine's amax_and_scale_update_after_reduction, in fp64 with one rounding to the fp32
    the scale is stored in (newest history entry first here). megafp8's one documented difference: an
    inf/NaN step amax is recorded as 0, so it cannot pin a max history (TE records it; for NaN TE's fmaxf
    ignores it anyway, so only inf differs)."""
    recorded = step_amax if math.isfinite(step_amax) else 0.0
    if step_amax != 0:  # a 0 step leaves the history alone; NaN != 0
        history = [recorded] + history[:-1]
    amax = recorded if recipe.amax_compute_algo == "most_recent" else max(history)
    if amax > 0:
        scale = _fp32(fp8_max * 2.0 ** -recipe.margin / amax)
        if math.isinf(scale):
            scale = FP32_MAX
        if recipe.power_of_2_scale:
            scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return history, scale


def test_update_matches_an_fp64_transformer_engine_reference():
    """Mixed recipes in one manager (history lengths 1/3/5, max/most_recent, margins, power-of-two, E4M3/E5M2),
    several steps of 0-3 micro-batches each with random amaxes including 0, inf, NaN and a subnormal one
    (whose scale overflows fp32): every history and scale equals the reference exactly."""
    rng = random.Random(0)
    specs = []
    for length in (1, 3, 5):
        for algo in ("max", "most_recent"):
            for margin, pow2 in ((0, False), (2, False), (0, True), (3, True)):
                dtype = rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])
                specs.append((Fp8Recipe(amax_history_len=length, amax_compute_algo=algo, margin=margin,
                                        power_of_2_scale=pow2), dtype))
    model = _States(specs)
    manager = Fp8ScalingManager(model, None)
    reference = [([0.0] * recipe.amax_history_len, 1.0) for recipe, _ in specs]

    def random_amax() -> float:
        kind = rng.random()
        if kind < 0.08:
            return 0.0
        if kind < 0.14:
            return math.inf
        if kind < 0.20:
            return math.nan
        if kind < 0.24:
            return _fp32(1e-40)
        return _fp32(2.0 ** rng.uniform(-30, 30))

    for _ in range(12):
        for i, (state, (recipe, dtype)) in enumerate(zip(model.states, specs)):
            observed = [random_amax() for _ in range(rng.randrange(4))]
            for amax in observed:
                state.observe(torch.tensor(amax))
            step = math.nan if any(math.isnan(a) for a in observed) else max(observed, default=0.0)
            reference[i] = _te_update(*reference[i], step, recipe, E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX)
        manager.update()
        for state, (history, scale) in zip(model.states, reference):
            assert state.amax_history.tolist() == history
            assert state.scale.item() == scale
            assert state.pending_amax.item() == 0.0


def test_formula_and_margin():
    """scale = FP8_MAX / amax / 2**margin (TransformerEngine), computed from the history."""
    s, m = _single(amax_history_len=4, margin=0)
    _step(s, m, 3.5)
    assert s.scale.item() == _fp32(E4M3_MAX / 3.5)
    s2, m2 = _single(amax_history_len=4, margin=2)
    _step(s2, m2, 3.5)
    assert s2.scale.item() == _fp32(E4M3_MAX / 3.5 / 4)
    holder = _States([(Fp8Recipe(amax_history_len=2), torch.float8_e5m2)])
    _step(holder.states[0], Fp8ScalingManager(holder, None), 2.0)
    assert holder.states[0].scale.item() == E5M2_MAX / 2.0


def test_history_roll_and_compute_algo():
    """The history holds the last L step amaxes, newest first; `max` uses all, `most_recent` the newest."""
    holder = _States([(Fp8Recipe(amax_history_len=3), torch.float8_e4m3fn),
                      (Fp8Recipe(amax_history_len=3, amax_compute_algo="most_recent"), torch.float8_e4m3fn)])
    by_max, by_recent = holder.states
    manager = Fp8ScalingManager(holder, None)
    for amax in (8.0, 2.0, 1.0, 0.5):
        by_max.observe(torch.tensor(amax))
        by_recent.observe(torch.tensor(amax))
        manager.update()
    assert by_max.amax_history.tolist() == [0.5, 1.0, 2.0]  # 8.0 rolled out after 3 newer steps
    assert by_max.scale.item() == pytest.approx(E4M3_MAX / 2.0)
    assert by_recent.scale.item() == pytest.approx(E4M3_MAX / 0.5)


def test_micro_batch_amaxes_fold_into_the_step_max():
    s, m = _single(amax_history_len=2)
    for amax in (1.0, 7.0, 3.0):  # three micro-batches
        s.observe(torch.tensor(amax))
    m.update()
    assert s.amax_history.tolist() == [7.0, 0.0] and s.pending_amax.item() == 0.0


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_zero_or_non_finite_amax_keeps_previous_scale(bad):
    s, m = _single(amax_history_len=1, amax_compute_algo="most_recent")
    _step(s, m, 4.0)
    before = s.scale.item()
    _step(s, m, bad)
    assert s.scale.item() == before
    _step(s, m, 2.0)  # the bad step must not pin later updates
    assert s.scale.item() == pytest.approx(E4M3_MAX / 2.0)


def test_non_finite_amax_does_not_poison_a_max_history_and_zero_does_not_age_it():
    s, m = _single(amax_history_len=3)
    _step(s, m, 4.0)
    _step(s, m, float("nan"))
    assert s.amax_history.tolist() == [0.0, 4.0, 0.0]
    assert s.scale.item() == pytest.approx(E4M3_MAX / 4.0)
    m.update()  # nothing observed: the history does not age (TransformerEngine)
    assert s.amax_history.tolist() == [0.0, 4.0, 0.0]


def test_power_of_two_scale_rounds_down_and_a_tiny_amax_gives_fp32_max():
    s, m = _single(amax_history_len=1, power_of_2_scale=True)
    _step(s, m, 3.0)  # 448 / 3 = 149.3 -> 128
    assert s.scale.item() == 128.0
    s2, m2 = _single(amax_history_len=1)
    _step(s2, m2, 1e-40)  # 448 / 1e-40 overflows fp32: TransformerEngine uses fp32 max
    assert s2.scale.item() == FP32_MAX


def test_scaling_state_is_in_the_state_dict():
    layer = Fp8Linear(8, 8, recipe=Fp8Recipe(amax_history_len=5))
    keys = set(layer.state_dict())
    for role in ("input", "weight", "grad_output"):
        assert f"fp8_scaling.{role}.amax_history" in keys and f"fp8_scaling.{role}.scale" in keys
    assert layer.state_dict()["fp8_scaling.input.amax_history"].shape == (5,)


# ---- O(1) device ops per update ----

class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _gpt_like_states(num_layers: int, history: int = 16) -> nn.Module:
    """4 FP8 linears per transformer layer (QKV, proj, FC1, FC2), 3 roles each, as GPTModel has."""
    recipe = Fp8Recipe.delayed(amax_history_len=history)
    return nn.ModuleList(nn.ModuleList(Fp8Linear(8, 8, bias=False, recipe=recipe) for _ in range(4))
                         for _ in range(num_layers))


def _update_ops(num_layers: int) -> list[str]:
    model = _gpt_like_states(num_layers)
    manager = Fp8ScalingManager(model, None)
    generator = torch.Generator().manual_seed(num_layers)
    for step in range(3):
        for state in (m for m in model.modules() if isinstance(m, ScalingState)):
            state.observe(torch.rand((), generator=generator))
        if step < 2:
            manager.update()  # the first update builds the flat buffers
        else:
            with _OpCounter() as counter:
                manager.update()
    return counter.ops


def test_update_issues_the_same_few_ops_at_any_layer_count():
    small, large = _update_ops(4), _update_ops(32)
    assert small == large, "update() must not loop over states on the device"
    assert len(large) <= 25, large
    assert not any("lift_fresh" in op or "_to_copy" in op for op in large), "no host-to-device copies per step"


def test_two_models_with_their_own_managers_do_not_make_each_other_rebuild():
    models = [_gpt_like_states(2), _gpt_like_states(3)]
    managers = [Fp8ScalingManager(model, None) for model in models]
    for step in range(3):
        for model, manager in zip(models, managers):
            for state in (m for m in model.modules() if isinstance(m, ScalingState)):
                state.observe(torch.tensor(1.0 + step))
            with _OpCounter() as counter:
                manager.update()
            if step > 0:  # the first step builds each manager's flat buffers; no rebuild after that
                assert len(counter.ops) <= 25, counter.ops


# ---- flat buffers: views through casts, loads and a second manager ----

def _observed_step(model: nn.Module, manager: Fp8ScalingManager, amax: float) -> None:
    for state in (m for m in model.modules() if isinstance(m, ScalingState)):
        state.observe(torch.tensor(amax))
    manager.update()


def test_states_are_views_of_flat_buffers_that_survive_casts_loads_and_a_second_manager():
    model = _gpt_like_states(2, history=4)
    manager = Fp8ScalingManager(model, None)
    _observed_step(model, manager, 3.0)
    states = manager.states()
    flat_history = states[0].amax_history._base
    assert flat_history is not None and all(s.amax_history._base is flat_history for s in states)
    scales = [s.scale.item() for s in states]
    assert scales[0] == _fp32(E4M3_MAX / 3.0) != torch.tensor(scales[0]).bfloat16().item()
    model.bfloat16()  # a model cast keeps the fp32 values, unrounded
    assert all(s.scale.dtype == torch.float32 for s in states) and [s.scale.item() for s in states] == scales
    _observed_step(model, manager, 7.0)
    assert all(s.amax_history[:2].tolist() == [7.0, 3.0] for s in states)

    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _observed_step(model, manager, 1.0)
    model.load_state_dict(saved)  # in place: the views stay the manager's
    assert all(s.amax_history[:2].tolist() == [7.0, 3.0] for s in states)
    model.load_state_dict(saved, assign=True)  # replaces the tensors: the manager rebuilds
    _observed_step(model, manager, 0.5)
    assert all(s.amax_history[:3].tolist() == [0.5, 7.0, 3.0] for s in manager.states())

    copied = pickle.loads(pickle.dumps(copy.deepcopy(model)))  # copies belong to no manager
    assert all(s._owner is None for s in copied.modules() if isinstance(s, ScalingState))
    other = Fp8ScalingManager(model, None)  # takes the states over; the first one rebuilds when used again
    _observed_step(model, other, 0.25)
    _observed_step(model, manager, 0.125)
    assert all(s.amax_history.tolist() == [0.125, 0.25, 0.5, 7.0] for s in manager.states())


def test_is_cold_until_an_update_records_an_observed_amax_and_after_a_reload():
    model = _gpt_like_states(1, history=4)
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    assert all(s.is_cold for s in states)
    states[0].observe(torch.tensor(2.0))  # observed before any manager exists
    manager = Fp8ScalingManager(model, None)
    assert states[0].is_cold, "observed but not yet folded into a history"
    manager.update()
    assert not states[0].is_cold and all(s.is_cold for s in states[1:])
    states[1].observe(torch.tensor(2.0))
    manager.update()
    assert [s.is_cold for s in states[:3]] == [False, False, True]

    fresh = _gpt_like_states(1, history=4)
    fresh.load_state_dict(model.state_dict())
    loaded = [m for m in fresh.modules() if isinstance(m, ScalingState)]
    assert [s.is_cold for s in loaded] == [s.is_cold for s in states]
    assert torch.equal(loaded[0].amax_history, states[0].amax_history)


# ---- loads without scaling state ----

def test_a_state_dict_without_scaling_state_loads_strictly_into_fresh_cold_states():
    model = _gpt_like_states(2, history=4)
    manager = Fp8ScalingManager(model, None)
    _observed_step(model, manager, 3.0)
    weights_only = {k: v for k, v in model.state_dict().items() if "fp8_scaling" not in k}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        model.load_state_dict(weights_only, strict=True)
    assert [str(w.message) for w in caught] == [FRESH_STATE_WARNING], "warned once, not once per state"
    for state in manager.states():
        assert state.is_cold and state.scale.item() == 1.0 and not state.amax_history.any()
    with pytest.raises(RuntimeError, match="amax_history"):  # a partial scaling state is still an error
        model.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("amax_history")})


def test_hf_llama_checkpoint_loads_strictly_into_a_delayed_fp8_gpt_model():
    transformers = pytest.importorskip("transformers")
    from megafp8.model import GPTModel, ModelConfig
    from megafp8.model.hf_mapping import from_hf_state_dict, hf_llama_config_kwargs
    from megafp8.parallel.parallel_state import ParallelState

    config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                         seq_length=16, max_position_embeddings=32, vocab_size=100, make_vocab_size_divisible_by=16)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config_kwargs(config))).eval()
    model = GPTModel(config, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed(amax_history_len=4))
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    assert len(states) == 2 * 4 * 3
    with pytest.warns(UserWarning, match="start fresh"):
        model.load_state_dict(from_hf_state_dict(hf.state_dict(), config), strict=True)
    assert torch.equal(model.layers["1"].mlp.linear_fc2.weight, hf.model.layers[1].mlp.down_proj.weight)
    assert all(s.is_cold and s.scale.item() == 1.0 and not s.amax_history.any() for s in states)


# ---- the amax group: required, and one all-reduce per step across ranks ----

def test_manager_needs_its_amax_group_argument():
    with pytest.raises(TypeError, match="amax_group"):
        Fp8ScalingManager(nn.Linear(2, 2))


def _amax_body(rank: int, world: int) -> None:
    torch.manual_seed(0)  # same weights on both ranks
    model = nn.Sequential(Fp8Linear(32, 64, recipe=Fp8Recipe()), Fp8Linear(64, 16, recipe=Fp8Recipe()))
    with pytest.raises(ValueError, match="amax group"):
        Fp8ScalingManager(model, None)  # WORLD would mix pipeline stages: the group must be given
    calls = []

    def counting_all_reduce_max(tensor, group):
        calls.append(tensor.numel())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

    manager = Fp8ScalingManager(model, dist.group.WORLD, all_reduce_max=counting_all_reduce_max)
    for step in range(2):
        for micro in range(3):
            x = torch.randn(8, 32) * (1 + 10 * rank) * (micro + 1)  # ranks see different amaxes
            model(x).square().sum().backward()
        manager.update()
    # 2 steps -> 2 collectives, each carrying all 6 states (2 layers x input/weight/grad_output).
    assert calls == [6, 6]
    scales = torch.stack([s.scale for s in manager.states()])
    gathered = [torch.empty_like(scales) for _ in range(world)]
    dist.all_gather(gathered, scales)
    assert torch.equal(gathered[0], gathered[1]), "ranks must end with identical scales"
    history = model[0].fp8_scaling["input"].amax_history[:2].clone()
    peer = [torch.empty_like(history) for _ in range(world)]
    dist.all_gather(peer, history)
    assert torch.equal(peer[0], peer[1]) and history[0] > 0


@pytest.mark.distributed
def test_amax_reduction_is_one_collective_per_step_and_scales_agree():
    run_distributed(_amax_body, world_size=2)
