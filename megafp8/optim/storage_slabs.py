"""The optimizer's flat storage (every bucket shard of this rank, consecutive) cut into slabs the step takes at once."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megafp8.parallel.data_parallel import Bucket


@dataclass(eq=False)
class StorageSlab:
    """Storage ``[start, start + n)``: the pieces ``[lo, hi)`` of bucket shards it covers, in storage order."""

    start: int
    n: int
    pieces: list[tuple[Bucket, int, int]]
    grads: list[torch.Tensor]  # the pieces' grad_data views, built once (the grad buffers live as long as the run)

    @property
    def sizes(self) -> list[int]:
        return [hi - lo for _b, lo, hi in self.pieces]


STEP_SLAB = 1 << 22  # storage elements the step takes at once: bounds its temporaries, whatever the bucket sizes


def cut_into_slabs(lengths: list[int], size: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive runs of these lengths cut into slabs of ``size``: per slab, its pieces (run, offset in the
    run, length), in order; a run may span slabs, a slab may hold several runs."""
    slabs, pieces, filled = [], [], 0
    for run, length in enumerate(lengths):
        offset = 0
        while offset < length:
            take = min(length - offset, size - filled)
            pieces.append((run, offset, take))
            offset, filled = offset + take, filled + take
            if filled == size:
                slabs.append(pieces)
                pieces, filled = [], 0
    if pieces:
        slabs.append(pieces)
    return slabs


def storage_slabs(shards: list[tuple[Bucket, int, int, int]], size: int) -> list[StorageSlab]:
    """The storage (bucket shards, consecutive) cut into slabs of ``size`` elements (a multiple of GROUP)."""
    slabs, start = [], 0
    for pieces in cut_into_slabs([hi - lo for _b, lo, hi, _storage in shards], size):
        parts = [(shards[run][0], shards[run][1] + offset, shards[run][1] + offset + n) for run, offset, n in pieces]
        n = sum(hi - lo for _b, lo, hi in parts)
        slabs.append(StorageSlab(start, n, parts, [b.grad_data[lo:hi] for b, lo, hi in parts]))
        start += n
    return slabs
