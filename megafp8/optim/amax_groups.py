"""Which ranks agree on a weight's amax: the holders of its ZeRO shards. A dense weight's shards spread over the
data-parallel group; an expert's (expert parallelism) over its expert-data-parallel group, the ranks holding the same
experts in the same order. A vector of per-weight (or per-scale-slot) amaxes is MAX-reduced over each group on that
group's positions; when every weight is dense, in the one collective over DP it always was."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megafp8.parallel import collectives as C
from megafp8.parallel.placement import placement_of

Members = list[tuple[object, torch.Tensor | None]]  # (group handle, positions of the vector; None: all of them)


def amax_group(opt, param: torch.Tensor):
    """The optimizer's DP group for a dense weight, its bucket's (expert-data-parallel) group for an expert's."""
    return opt.dp if placement_of(param).grad_sync_group == "dp" else opt.ddp.bucket_of[param].group


def members_by_group(groups: Sequence, dense, device) -> Members:
    """Each group with the positions whose amax it agrees (built once, on the host, per layout)."""
    if all(group is dense for group in groups):
        return [(dense, None)]
    positions: dict[int, tuple[object, list[int]]] = {}
    for i, group in enumerate(groups):
        positions.setdefault(id(group), (group, []))[1].append(i)
    return [(group, torch.tensor(index, dtype=torch.int64, device=device)) for group, index in positions.values()]


def all_reduce_max(vector: torch.Tensor, members: Members, kind: str) -> torch.Tensor:
    """MAX over each group of its positions of ``vector``, in place (one collective per group)."""
    for group, index in members:
        if index is None:
            C.all_reduce(vector, group, kind, op=dist.ReduceOp.MAX)
            continue
        part = vector.index_select(0, index)
        C.all_reduce(part, group, kind, op=dist.ReduceOp.MAX)
        vector.index_copy_(0, index, part)
    return vector
