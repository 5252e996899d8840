"""PrecisionSchedule: the FP4 papers' late switch to higher precision. From a given iteration on, every layer that
runs an FP4 recipe moves (through its PrecisionPlan, reason "schedule") to a wider recipe, or to high precision, or
(the NVFP4 paper's variant) keeps its recipe for dgrad and wgrad and runs only the forward GEMM in high precision.

The switch is a function of the iteration alone, so a run resumed after it switches again before its first step:
nothing to save, and the resumed run is bit-exact with the straight one."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .precision_plan import SCHEDULE, PrecisionChange, PrecisionPlan
from .recipe import Fp8Recipe

GEMM_SCOPES = ("all", "fprop")


@dataclass
class PrecisionSchedule:
    """at:    the first iteration (1-based) that runs in the new precision
    then:  the recipe FP4 layers move to (None: high precision); with gemms="fprop" it is unused
    gemms: "all" (every GEMM of the layer moves) or "fprop" (only the forward GEMM, in high precision)"""

    at: int
    then: Fp8Recipe | None = None
    gemms: str = "all"
    done: bool = False

    def __post_init__(self) -> None:
        if self.gemms not in GEMM_SCOPES:
            raise ValueError(f"precision schedule gemms {self.gemms!r} is not one of {', '.join(GEMM_SCOPES)}")

    def apply(self, plans: Iterable[PrecisionPlan], iteration: int) -> list[PrecisionChange]:
        """Before `iteration`'s forward: switch once it is due (again after a resume past it)."""
        if self.done or iteration < self.at:
            return []
        changes = []
        for plan in plans:
            for name in plan.names():
                recipe = plan.recipe_of(name)
                if recipe is None or recipe.element_bits != 4:
                    continue
                target = recipe.replace(fprop_high_precision=True) if self.gemms == "fprop" else self.then
                changes += plan.set_recipe(name, target, SCHEDULE, ladder=(target, None) if target is not None else None)
        self.done = True
        return changes

    def describe(self) -> str:
        to = ("the forward GEMMs in high precision (dgrad/wgrad stay FP4)" if self.gemms == "fprop"
              else f"{self.then.scaling} {self.then.fp8_format}" if self.then is not None else "high precision")
        return f"FP4 layers switch to {to} at iteration {self.at}"
