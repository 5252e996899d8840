"""PrecisionPlan: the one record of each FP8-capable layer's recipe, its only writer, and the callbacks that follow it."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from .linear import Fp8GemmModule
from .recipe import Fp8Recipe

# Why a layer runs with its recipe: the build (precision map, output head), the saturation guard, a schedule, or
# nothing (no own recipe: it follows fp8_autocast, high precision outside one).
CONFIG, GUARD, SCHEDULE, AUTOCAST = "config", "guard", "schedule", "autocast"

# Layer -> weak reference to its plan. Weak both ways: the plan (owned by its model) holds its layers, and a layer
# copied on its own belongs to no plan (a plan copied with its model registers the copies: __setstate__).
_PLAN_OF_LAYER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class LayerPrecision:
    """Where one layer stands: its recipe (None: high precision, or fp8_autocast's with reason AUTOCAST), the
    recipes it may be moved through, widest first and ending in None (FP8 -> high precision today; FP4 -> FP8 ->
    BF16 later), and why it is where it is."""

    module: Fp8GemmModule
    recipe: Fp8Recipe | None
    ladder: tuple[Fp8Recipe | None, ...]
    reason: str

    @property
    def high_precision(self) -> bool:
        return self.recipe is None and self.reason != AUTOCAST


@dataclass(frozen=True)
class PrecisionChange:
    """One layer's move, as the plan's callbacks receive it (new None: the layer now runs in high precision)."""

    name: str
    module: Fp8GemmModule
    old: Fp8Recipe | None
    new: Fp8Recipe | None
    reason: str


PrecisionCallback = Callable[[list[PrecisionChange]], None]


def weight_format_bits(recipe: Fp8Recipe) -> int:
    return recipe.quantizer("weight").format.bits


class PrecisionPlan:
    """The recipe of every FP8-capable layer of `model` (by qualified name) that no other plan holds.

    Writers: set_recipe (the build's precision map, a schedule) and demote (the saturation guard: one step down the
    ladder). Each write is projected onto the layer's own attributes (recipe, force_high_precision,
    guard_high_precision), which every GEMM and existing reader keeps reading: they are this plan's projection and
    nothing else writes them once the plan exists. Followers (DDP, the optimizer, the pipeline's scaling manager)
    register on_change and receive each write's list of changes instead of polling the layers.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers: dict[str, LayerPrecision] = {}
        self._name_of: dict[nn.Module, str] = {}
        self._callbacks: list[PrecisionCallback] = []
        for name, module in model.named_modules():
            if isinstance(module, Fp8GemmModule) and plan_of(module) is None:
                self._adopt(name, module)

    def _adopt(self, name: str, module: Fp8GemmModule) -> None:
        """Record a layer as it stands (its flags were written by its constructor or before this plan existed)."""
        recipe = None if module.runs_high_precision else module.recipe
        if module.guard_high_precision:
            reason = GUARD
        else:
            reason = CONFIG if module.force_high_precision or module.recipe is not None else AUTOCAST
        ladder = (module.recipe, None) if module.recipe is not None else (None,)
        self._layers[name] = LayerPrecision(module, recipe, ladder, reason)
        self._name_of[module] = name
        _PLAN_OF_LAYER[module] = weakref.ref(self)

    # ---- readers ----
    def names(self) -> list[str]:
        return list(self._layers)

    def layer(self, name: str) -> LayerPrecision:
        return self._layers[name]

    def name_of(self, module: nn.Module) -> str:
        return self._name_of[module]

    def __contains__(self, module: nn.Module) -> bool:
        return module in self._name_of

    def recipe_of(self, name: str) -> Fp8Recipe | None:
        return self._layers[name].recipe

    def ladder(self, name: str) -> tuple[Fp8Recipe | None, ...]:
        return self._layers[name].ladder

    def reason_of(self, name: str) -> str:
        return self._layers[name].reason

    def widest_bits(self, name: str, bits_of: Callable[[Fp8Recipe], int] = weight_format_bits) -> int | None:
        """Bits per element of the widest weight format on the layer's ladder: what a low-precision gather buffer
        holding this weight must be sized for, whichever rung it is on. None when the ladder has no such format."""
        bits = [bits_of(recipe) for recipe in self._layers[name].ladder if recipe is not None]
        return max(bits) if bits else None

    def has_delayed_recipe(self) -> bool:
        """Whether any layer now runs a recipe whose scales come from per-layer state (a scaling manager's work)."""
        return any(e.recipe is not None and e.recipe.is_delayed for e in self._layers.values())

    # ---- writers ----
    def set_recipe(self, names: str | Iterable[str], recipe: Fp8Recipe | None, reason: str = SCHEDULE,
                   ladder: tuple[Fp8Recipe | None, ...] | None = None) -> list[PrecisionChange]:
        """Move the named layers to `recipe` (None: high precision). Their ladder becomes `ladder` when given, stays
        when `recipe` is on it, else becomes (recipe, None)."""
        changes = []
        for name in [names] if isinstance(names, str) else names:
            entry = self._layers[name]
            if ladder is None and recipe not in entry.ladder:
                entry.ladder = (recipe, None)
            elif ladder is not None:
                entry.ladder = tuple(ladder)
            changes += self._write(name, entry, recipe, reason)
        self._notify(changes)
        return changes

    def demote(self, name: str, reason: str = GUARD) -> list[PrecisionChange]:
        """One step down the layer's ladder (from its bottom, or from a recipe off it: high precision)."""
        entry = self._layers[name]
        rung = entry.ladder.index(entry.recipe) if entry.recipe in entry.ladder and entry.reason != AUTOCAST else None
        below = entry.ladder[rung + 1] if rung is not None and rung + 1 < len(entry.ladder) else None
        changes = self._write(name, entry, below, reason)
        self._notify(changes)
        return changes

    def on_change(self, callback: PrecisionCallback) -> PrecisionCallback:
        """Call `callback(changes)` after every write that moved a layer; returns it (for remove_callback)."""
        self._callbacks.append(callback)
        return callback

    def remove_callback(self, callback: PrecisionCallback) -> None:
        self._callbacks.remove(callback)

    def _write(self, name: str, entry: LayerPrecision, recipe: Fp8Recipe | None, reason: str) -> list[PrecisionChange]:
        old, old_high = entry.recipe, entry.high_precision
        entry.recipe, entry.reason = recipe, reason
        _project(entry)
        if (old, old_high) == (recipe, entry.high_precision):
            return []
        return [PrecisionChange(name, entry.module, old, recipe, reason)]

    def _notify(self, changes: list[PrecisionChange]) -> None:
        if changes:
            for callback in list(self._callbacks):
                callback(changes)

    # ---- copies (deepcopy, pickle): the layers come along, the followers do not ----
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_callbacks": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for module in self._name_of:
            _PLAN_OF_LAYER[module] = weakref.ref(self)


def _project(entry: LayerPrecision) -> None:
    """The layer's own attributes from the plan's entry: each reason sets the flag the layer has always had for it
    (force_high_precision for the build or a schedule, guard_high_precision for the guard)."""
    module = entry.module
    if entry.recipe is not None:
        module.force_high_precision = module.guard_high_precision = False
        module.set_recipe(entry.recipe)
    elif entry.reason == GUARD:
        module.guard_high_precision = True
    elif entry.reason != AUTOCAST:
        module.force_high_precision = True


def plan_of(layer: nn.Module) -> PrecisionPlan | None:
    """The plan that writes this layer's precision, if any."""
    ref = _PLAN_OF_LAYER.get(layer)
    return ref() if ref is not None else None


def precision_plan(model: nn.Module) -> PrecisionPlan:
    """The plan `model` owns (GPTModel builds its own), else a new one over its FP8 layers that no plan holds yet,
    owned by `model` from now on."""
    plan = model.__dict__.get("precision_plan")
    if plan is None:
        plan = PrecisionPlan(model)
        model.precision_plan = plan
    return plan


def precision_plans(model: nn.Module) -> list[PrecisionPlan]:
    """Every plan writing `model`'s FP8 layers (one per pipeline chunk), `model`'s own created for layers none holds."""
    layers = [m for m in model.modules() if isinstance(m, Fp8GemmModule)]
    if any(plan_of(m) is None for m in layers):
        plan = model.__dict__.get("precision_plan")
        if plan is None:
            precision_plan(model)
        else:  # layers added to a model after its plan was built
            for name, module in model.named_modules():
                if isinstance(module, Fp8GemmModule) and plan_of(module) is None:
                    plan._adopt(name, module)
    return list(dict.fromkeys(plan_of(m) for m in layers))


def demote_layer(layer: Fp8GemmModule, reason: str = GUARD) -> list[PrecisionChange]:
    """One step down `layer`'s ladder through its plan (a layer outside any plan gets one of its own)."""
    plan = plan_of(layer) or precision_plan(layer)
    return plan.demote(plan.name_of(layer), reason)
