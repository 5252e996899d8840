"""fp8_autocast: turn FP8 on or off for the Fp8Linear layers run inside a block (TransformerEngine-style)."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from .recipe import Fp8Recipe


@dataclass(frozen=True)
class _AutocastState:
    enabled: bool
    recipe: Fp8Recipe | None


_STATE: contextvars.ContextVar[_AutocastState | None] = contextvars.ContextVar("megafp8_fp8_autocast", default=None)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Fp8Recipe | None = None):
    """Inside, Fp8Linear layers without their own recipe use `recipe`; enabled=False runs every layer
    in high precision (e.g. the BF16 baseline of a numerics report). Layers built with a recipe keep it."""
    if enabled and recipe is None:
        recipe = Fp8Recipe()
    token = _STATE.set(_AutocastState(enabled, recipe))
    try:
        yield
    finally:
        _STATE.reset(token)


def fp8_enabled() -> bool:
    state = _STATE.get()
    return state is not None and state.enabled


def resolve_recipe(layer_recipe: Fp8Recipe | None, force_high_precision: bool) -> Fp8Recipe | None:
    """The recipe a layer runs with now: None means high precision."""
    state = _STATE.get()
    if force_high_precision or (state is not None and not state.enabled):
        return None
    if layer_recipe is not None:
        return layer_recipe
    return state.recipe if state is not None else None
