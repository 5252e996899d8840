"""Precision map: which transformer layers run their linears in FP8 and which stay in high precision.

Embedding, output head, norms, softmax and the loss are never FP8 (they are not Fp8Linear layers).
`--first-last-layers-bf16 N` keeps the first and last N transformer blocks in BF16, where FP8 hurts
most (FP8-LM, DeepSeek-V3 keep sensitive layers in higher precision).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .linear import Fp8GemmModule
from .precision_plan import CONFIG, plan_of
from .recipe import Fp8Recipe


def layer_recipes(num_layers: int, recipe: Fp8Recipe | None, first_last_layers_bf16: int = 0) -> list[Fp8Recipe | None]:
    """The recipe of each transformer block (None = high precision)."""
    if first_last_layers_bf16 < 0:
        raise ValueError(f"--first-last-layers-bf16 must be >= 0, got {first_last_layers_bf16}")
    if recipe is None:
        return [None] * num_layers
    n = first_last_layers_bf16
    return [None if i < n or i >= num_layers - n else recipe for i in range(num_layers)]


def apply_precision_map(blocks: Sequence[nn.Module], recipes: Sequence[Fp8Recipe | None]) -> None:
    """Give every FP8-capable linear in block i the recipe recipes[i]; None forces high precision. Through the layer's
    PrecisionPlan when it has one (the plan then projects the same flags), else written on the layer directly."""
    if len(blocks) != len(recipes):
        raise ValueError(f"{len(blocks)} blocks but {len(recipes)} recipes")
    for block, recipe in zip(blocks, recipes):
        for module in block.modules():
            if not isinstance(module, Fp8GemmModule):
                continue
            plan = plan_of(module)
            if plan is not None:
                ladder = recipe.guard_ladder() if recipe is not None else None  # FP4 -> FP8 -> BF16 for FP4
                plan.set_recipe(plan.name_of(module), recipe, CONFIG, ladder=ladder)
                continue
            module.force_high_precision = recipe is None
            if recipe is not None:
                module.set_recipe(recipe)
