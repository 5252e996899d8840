"""fp8_autocast: turn FP8 on or off for the Fp8Linear layers run inside a block (TransformerEngine-style)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .recipe import Fp8Recipe


@dataclass(frozen=True)
class _AutocastState:
    enabled: bool
    recipe: Fp8Recipe | None


class _AutocastStack:
    """The active fp8_autocast, innermost last.

    A plain module-level object rather than a ContextVar: torch.compile (dynamo) cannot trace
    ContextVar.get and broke the graph at every FP8 layer, whereas it reads and guards on a global
    object's attributes (a compiled region recompiles when the active recipe changes). The state is
    per process, not per thread or asyncio task, as TransformerEngine's FP8GlobalStateManager is: a
    training process runs its forward passes on one thread.
    """

    def __init__(self) -> None:
        self.current: _AutocastState | None = None


_STATE = _AutocastStack()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Fp8Recipe | None = None):
    """Inside, Fp8Linear layers without their own recipe use `recipe`; enabled=False runs every layer
    in high precision (e.g. the BF16 baseline of a numerics report). Layers built with a recipe keep it."""
    if enabled and recipe is None:
        recipe = Fp8Recipe()
    outer = _STATE.current
    _STATE.current = _AutocastState(enabled, recipe)
    try:
        yield
    finally:
        _STATE.current = outer


def fp8_enabled() -> bool:
    state = _STATE.current
    return state is not None and state.enabled


def resolve_recipe(layer_recipe: Fp8Recipe | None, force_high_precision: bool) -> Fp8Recipe | None:
    """The recipe a layer runs with now: None means high precision."""
    state = _STATE.current
    if force_high_precision or (state is not None and not state.enabled):
        return None
    if layer_recipe is not None:
        return layer_recipe
    return state.recipe if state is not None else None
