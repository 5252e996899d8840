"""The saturation guard's three-level ladder for FP4 layers: a saturating NVFP4 layer moves to its FP8 fallback
(--fp4-guard-fallback, MXFP8 by default), is checked afresh there, and moves to high precision only if it saturates
again; the guard's checkpoint keeps each layer's rung, and a checkpoint from before the ladder (no "demotions")
still loads as one step. FP8 layers keep their single step to BF16."""
import torch
from torch import nn

from megafp8.checkpoint.save_load import _restore_guard
from megafp8.fp8 import Fp8Linear, Fp8Recipe, SaturationGuard, apply_precision_map, precision_plan
from megafp8.fp8.kurtosis import KurtosisAlarm, KurtosisWarning
from megafp8.fp8.telemetry import Fp8TensorStats

NUMEL = 1000


def _model(recipe: Fp8Recipe, layers: int = 2) -> nn.Sequential:
    model = nn.Sequential(*[nn.Sequential(Fp8Linear(32, 32, recipe=recipe)) for _ in range(layers)])
    precision_plan(model)
    apply_precision_map(list(model), [recipe] * layers)
    return model


def _record(model: nn.Module, saturated: list[int]) -> None:
    for block, count in zip(model, saturated):
        layer = block[0]
        if not layer.runs_high_precision:
            layer.fp8_telemetry = {"input": Fp8TensorStats(torch.ones(()), torch.ones(()),
                                                           torch.tensor([count, 0]), NUMEL)}


def _check(guard, model, iteration, saturated):
    _record(model, saturated)
    return guard.check(model, iteration)


def test_an_fp4_layer_steps_down_to_fp8_then_to_high_precision():
    model = _model(Fp8Recipe.named("nvfp4"))
    layer, other = model[0][0], model[1][0]
    guard = SaturationGuard(threshold=0.01, patience=2)
    messages = []
    for it in (1, 2):
        messages += _check(guard, model, it, [50, 0])
    assert layer.recipe.scaling == "mxfp8" and not layer.runs_high_precision
    assert messages == ["fp8 guard: 0.0 saturated 5.00% > 1.00% for 2 checks at iteration 2: switched to mxfp8 e4m3"]
    assert other.recipe.scaling == "nvfp4" and guard.demotions == {"0.0": 1}
    # One saturated check in FP8 is not enough: the strikes started afresh at the move.
    assert _check(guard, model, 3, [50, 0]) == [] and layer.recipe.scaling == "mxfp8"
    messages = _check(guard, model, 4, [50, 0])
    assert layer.runs_high_precision and messages[0].endswith("switched to high precision")
    assert guard.demotions == {"0.0": 2} and guard.switched == {"0.0"}

    # A resumed run puts each layer back on its rung.
    state = guard.state_dict()
    fresh, fresh_guard = _model(Fp8Recipe.named("nvfp4")), SaturationGuard(threshold=0.01, patience=2)
    fresh_guard.load_state_dict(state, fresh)
    assert fresh[0][0].runs_high_precision and fresh[1][0].recipe.scaling == "nvfp4"
    # ... also through a checkpoint, which merges every rank's guard state (each rank's stage) first.
    restored, restored_guard = _model(Fp8Recipe.named("nvfp4")), SaturationGuard(threshold=0.01, patience=2)
    _restore_guard(restored_guard, [state, {"strikes": {}, "switched": []}], restored)
    assert restored[0][0].runs_high_precision and restored_guard.demotions == {"0.0": 2}
    one_step = {"strikes": {}, "switched": ["1.0"]}  # written before the ladder existed
    older, older_guard = _model(Fp8Recipe.named("nvfp4")), SaturationGuard(threshold=0.01, patience=2)
    older_guard.load_state_dict(one_step, older)
    assert older[1][0].recipe.scaling == "mxfp8" and older_guard.demotions == {"1.0": 1}


def test_fallback_bf16_skips_the_fp8_step_and_fp8_layers_keep_one_step():
    for recipe in (Fp8Recipe.named("nvfp4", fp4_guard_fallback="bf16"), Fp8Recipe.named("mxfp8"),
                   Fp8Recipe.tensorwise()):
        model = _model(recipe, layers=1)
        guard = SaturationGuard(threshold=0.01, patience=1)
        assert _check(guard, model, 1, [50])[0].endswith("switched to high precision"), recipe.scaling
        assert model[0][0].runs_high_precision


def test_the_ladder_is_the_recipes():
    nvfp4 = Fp8Recipe.named("nvfp4", fp4_guard_fallback="blockwise")
    assert [r.scaling if r else None for r in nvfp4.guard_ladder()] == ["nvfp4", "blockwise", None]
    assert Fp8Recipe.named("mxfp8").guard_ladder() == (Fp8Recipe.named("mxfp8"), None)


def test_a_kurtosis_alarm_steps_a_layer_down_at_once_and_its_windows_are_checkpointed():
    """--fp8-saturation-guard-kurtosis's switch (SaturationGuard.switch_early): the alarmed FP4 layer moves one rung
    (to its FP8 fallback) at that iteration without any saturation, the event names the kurtosis; the warning's
    windows travel in the guard's state (also through the checkpoint's merge) and come back on load."""
    model = _model(Fp8Recipe.named("nvfp4"))
    guard = SaturationGuard(threshold=0.01, patience=2)
    guard.kurtosis_warning = KurtosisWarning(ratio=2.0, window=3)
    _check(guard, model, 1, [0, 0])
    guard.kurtosis_warning.check(1, {"fp8/0.0/input/kurtosis": 3.0, "fp8/1.0/input/kurtosis": 3.0})
    alarms = guard.kurtosis_warning.check(2, {"fp8/0.0/input/kurtosis": 7.5, "fp8/1.0/input/kurtosis": 3.1})
    assert [a.layer for a in alarms] == ["0.0"]
    messages = guard.switch_early(model, alarms, 2)
    assert model[0][0].recipe.scaling == "mxfp8" and model[1][0].recipe.scaling == "nvfp4"
    assert messages == ["fp8 guard: 0.0 input kurtosis 7.5 reached 2.5x its recent low (3.0) at iteration 2: "
                        "switched to mxfp8 e4m3 (--fp8-saturation-guard-kurtosis)"]
    assert guard.take_events() == [{"iteration": 2, "layer": "0.0", "saturated": None, "kurtosis": 7.5}]
    assert guard.switch_early(model, [KurtosisAlarm("nope", 9.0, 3.0, "")], 3) == []  # not a layer: nothing
    _check(guard, model, 3, [0, 0])  # the guard goes on checking the remaining layers

    state = guard.state_dict()
    assert state["kurtosis_warning"] == {"history": {"0.0": [3.0, 7.5], "1.0": [3.0, 3.1]}, "warned": ["0.0"]}
    fresh, fresh_guard = _model(Fp8Recipe.named("nvfp4")), SaturationGuard(threshold=0.01, patience=2)
    fresh_guard.kurtosis_warning = KurtosisWarning(ratio=2.0, window=3)
    _restore_guard(fresh_guard, [state], fresh)
    assert fresh[0][0].recipe.scaling == "mxfp8" and fresh_guard.kurtosis_warning.state_dict() == \
        state["kurtosis_warning"]
