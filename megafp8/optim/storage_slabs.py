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


def storage_slabs(shards: list[tuple[Bucket, int, int, int]], size: int) -> list[StorageSlab]:
    """The storage (bucket shards, consecutive) cut into slabs of ``size`` elements (a multiple of GROUP)."""
    slabs, pieces, start, filled = [], [], 0, 0
    for bucket, lo, hi, _storage in shards:
        while lo < hi:
            take = min(hi - lo, size - filled)
            pieces.append((bucket, lo, lo + take))
            lo, filled = lo + take, filled + take
            if filled == size:
                slabs.append(StorageSlab(start, filled, pieces, [b.grad_data[a:z] for b, a, z in pieces]))
                start, pieces, filled = start + filled, [], 0
    if pieces:
        slabs.append(StorageSlab(start, filled, pieces, [b.grad_data[a:z] for b, a, z in pieces]))
    return slabs
