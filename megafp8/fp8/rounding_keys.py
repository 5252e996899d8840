"""Keys of the stochastic rounding of FP4 gradients: a pure function of (--seed, iteration, rank, layer, role, the
call's index in the iteration), so a resumed run draws the same bits and no generator state needs saving."""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from megafp8_kernels.counter_hash import rounding_key


class RoundingKeys:
    """One layer's keys for one iteration: each quantization of a gradient takes the next one (micro-batches and
    pipeline schedules run a layer's backwards in a fixed order, so the i-th call is the same call on a re-run)."""

    def __init__(self, seed: int = 0, iteration: int = 0, name: str = "") -> None:
        self.seed, self.iteration, self.name = seed, iteration, name
        self.calls = 0

    def next(self, role: str) -> int:
        key = rounding_key(self.seed, self.iteration, f"{self.name}/{role}/{self.calls}")
        self.calls += 1
        return key


def begin_rounding_iteration(chunks: Iterable[nn.Module], seed: int, iteration: int, rank: int) -> None:
    """Give every low-precision layer of this rank's model chunks its keys for `iteration` (the trainer calls this
    before each iteration's forward/backward when the recipe rounds stochastically)."""
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if hasattr(module, "rounding_keys"):
                module.rounding_keys = RoundingKeys(seed, iteration, f"rank{rank}/chunk{index}/{name}")
