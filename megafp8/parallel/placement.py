"""Where each parameter lives: which named group splits it, which group averages its gradient, which group copies it.

A ``Placement`` names process groups (``ParallelState.group(name)``), never holds them, so it is one frozen value per
parameter whatever the rank. The layers do not tag placements yet: ``placement_of`` derives today's from Megatron's
tags (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``padded_vocab``, ``sequence_parallel``,
``shared_embedding``); a parameter that carries an explicit ``placement`` attribute (an expert split over EP, say)
keeps it. The grad-norm counting, the DDP buffer keys and checkpoint sharding all read it from here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """One parameter's place in the mesh.

    shard_group      the group whose ranks each hold one piece of it (None: it is whole on each rank)
    shard_dim        the dimension it is split along; ``shard_stride`` blocks stacked along it are each split
                     (sharding.shard_tensor); ``padded_vocab``: its size along it depends on the group size
    replica_group    the model-parallel group whose ranks hold identical copies of it (TP for a norm weight): its
                     first rank alone counts it in the grad norm. Data-parallel copies are the grad-sync group's.
    grad_sync_group  the group averaging its gradient over data-parallel replicas (and spreading its ZeRO shards)
    grad_sum_group   the group whose partial gradients are summed first (TP for sequence-parallel weights)
    tied_copy        the last pipeline stage's copy of a tied embedding: counted and saved as the embedding
    """

    shard_group: str | None = None
    shard_dim: int | None = None
    shard_stride: int = 1
    padded_vocab: bool = False
    replica_group: str | None = None
    grad_sync_group: str = "dp"
    grad_sum_group: str | None = None
    tied_copy: bool = False

    def __post_init__(self) -> None:
        if (self.shard_group is None) != (self.shard_dim is None):
            raise ValueError(f"Placement: shard_group ({self.shard_group!r}) and shard_dim ({self.shard_dim!r}) "
                             "are given together or not at all")
        if self.shard_group is not None and self.shard_group == self.replica_group:
            raise ValueError(f"Placement: a parameter cannot be both split and copied over {self.shard_group!r}")

    @property
    def sharded(self) -> bool:
        return self.shard_group is not None

    def counts_in_grad_norm(self, group_rank: Callable[[str], int]) -> bool:
        """Whether this rank's piece enters the grad norm, so each element counts once: on every rank of the group
        splitting it, on the first rank of the group copying it, never for a tied copy (the embedding counts).
        ``group_rank(name)``: this rank's index in the named group."""
        if self.tied_copy:
            return False
        return self.replica_group is None or group_rank(self.replica_group) == 0


def shard_coords(placement: Placement, tp_rank: int, tp_size: int,
                 group_coords: Mapping[str, tuple[int, int]] | None) -> tuple[int, int]:
    """(rank, size) of this rank in the group splitting a parameter: from ``group_coords``
    (ParallelState.group_coordinates()) when it has the group, TP's own otherwise (or when nothing splits it)."""
    group = placement.shard_group
    if group_coords is not None and group in group_coords:
        return group_coords[group]
    if group in (None, "tp"):
        return tp_rank, tp_size
    raise ValueError(f"a parameter split over the {group!r} group needs that group's (rank, size) in group_coords "
                     "(ParallelState.group_coordinates()): without it, one rank's piece would stand for the whole")


def derive_placement(param: torch.Tensor) -> Placement:
    """Today's placement from Megatron's tags: a TP-tagged parameter is split over TP; any other is copied on
    every TP rank (its gradient first summed over TP when it is a sequence-parallel one)."""
    common = dict(grad_sum_group="tp" if getattr(param, "sequence_parallel", False) else None,
                  tied_copy=bool(getattr(param, "shared_embedding", False)))
    if getattr(param, "tensor_model_parallel", False):
        return Placement(shard_group="tp", shard_dim=param.partition_dim,
                         shard_stride=getattr(param, "partition_stride", 1),
                         padded_vocab=bool(getattr(param, "padded_vocab", False)), **common)
    return Placement(replica_group="tp", **common)


def placement_of(param: torch.Tensor) -> Placement:
    """The parameter's own ``placement`` when it was given one, else the one its tags imply."""
    placement = getattr(param, "placement", None)
    return placement if placement is not None else derive_placement(param)


def attach_placements(params: Iterable[torch.Tensor]) -> None:
    """Give every parameter its ``placement`` attribute (derived where it has none)."""
    for param in params:
        param.placement = placement_of(param)
