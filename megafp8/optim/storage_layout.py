"""Which parts of which parameters a DP rank owns and where they sit in its flat optimizer storage (Megatron's ranges),
with the per-128-element-group tables the optimizer's step broadcasts its per-parameter constants from.

Ranges (Megatron's four): a bucket's *world* range is ``[offset, offset + numel)`` of the grad buffer; this DP rank's
*local* (gbuf) range of it is ``[r S, (r+1) S)``; a parameter's *param* range is its ``[start, end)`` in the bucket;
their intersection is a ``Fragment``: the part of one parameter this rank owns, addressed in the parameter's own flat
index (``param_lo``/``param_hi``, what checkpoints store) and in this rank's flat storage (``storage_lo``). The
storage is the rank's bucket shards, consecutive. A fragment starts on a group boundary, so each group belongs to one
parameter (or to padding).
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from megafp8.optim.state_codec import GROUP
from megafp8.optim.storage_slabs import storage_slabs
from megafp8.parallel.data_parallel import Bucket, DistributedDataParallel
from megafp8.parallel.placement import placement_of


@dataclass(eq=False)
class Fragment:
    """The part ``[param_lo, param_hi)`` of one parameter that this rank owns."""

    index: int
    param: nn.Parameter
    name: str
    bucket: Bucket
    bucket_lo: int
    param_lo: int
    param_hi: int
    storage_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


class StorageLayout:
    """This DP rank's storage: ``fragments``; ``shards``, per bucket with a non-empty shard (bucket, local range
    ``[lo, hi)``, first storage index); ``slabs`` of up to ``slab_size`` elements (storage_slabs); and per storage
    group: ``frag_of_group`` (``len(fragments)`` for padding), ``index_offset`` (storage index -> the parameter's flat
    index), ``group_decay`` (weight decay applies), ``group_counted`` (the grad norm counts it), ``group_decoupled``
    (takes ``decoupled_lr``; None where this rank owns none of those parameters: one LR, as without); per fragment:
    ``param_of_frag`` (its parameter's position, for the DP amax agreement) and ``rounding_salts`` (the fp16
    master's stochastic rounding salt; one extra entry for padding). ``decoupled_launches``: the fused step's launches
    with two LRs, (bucket, grad_lo, storage start, n, takes decoupled_lr) per run of same-LR groups of each shard."""

    def __init__(self, ddp: DistributedDataParallel, *, weight_decay: float, decoupled_lr_params: Collection[str],
                 slab_size: int, device) -> None:
        self.fragments: list[Fragment] = []
        self.shards: list[tuple[Bucket, int, int, int]] = []
        storage = 0
        for bucket in ddp.buckets:
            lo, hi = bucket.shard_range(bucket.group.rank, bucket.group.size, ddp.distributed)
            for p in bucket.params:
                start, end = bucket.ranges[p]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    self.fragments.append(Fragment(len(self.fragments), p, ddp.param_names[p], bucket, a, a - start,
                                                   b - start, storage + a - lo))
            if hi > lo:
                self.shards.append((bucket, lo, hi, storage))
            storage += hi - lo
        self.numel = storage
        self.slabs = storage_slabs(self.shards, slab_size)

        groups, nfrag = self.numel // GROUP, len(self.fragments)
        frag_of_group = torch.full((groups,), nfrag, dtype=torch.int64)
        index_offset = torch.zeros(groups, dtype=torch.int64)
        decay, counted = torch.zeros(groups, dtype=torch.bool), torch.zeros(groups, dtype=torch.bool)
        decoupled = torch.zeros(groups, dtype=torch.bool)
        params = list(ddp.bucket_of)
        position = {p: i for i, p in enumerate(params)}
        salts = torch.zeros(nfrag + 1, dtype=torch.int64)
        group_rank = _group_rank(ddp)
        for frag in self.fragments:
            g = slice(frag.storage_lo // GROUP, -(-(frag.storage_lo + frag.numel) // GROUP))
            frag_of_group[g] = frag.index
            index_offset[g] = frag.param_lo - frag.storage_lo
            decay[g] = frag.param.dim() >= 2 and weight_decay > 0
            counted[g] = _counts_in_grad_norm(frag.param, group_rank)
            decoupled[g] = frag.name in decoupled_lr_params
            salts[frag.index] = zlib.crc32(_rounding_name(frag, group_rank).encode())
        self.frag_of_group, self.index_offset = frag_of_group.to(device), index_offset.to(device)
        self.group_decay, self.group_counted = decay.to(device), counted.to(device)
        self.param_of_frag = torch.tensor([position[f.param] for f in self.fragments], dtype=torch.int64, device=device)
        self.rounding_salts, self.num_params = salts.to(device), len(params)
        self.group_decoupled = decoupled.to(device) if bool(decoupled.any()) else None
        self.decoupled_launches = self._lr_launches(decoupled) if self.group_decoupled is not None else None

    def _lr_launches(self, decoupled: torch.Tensor) -> list[tuple[Bucket, int, int, int, bool]]:
        launches = []
        for bucket, lo, hi, storage in self.shards:  # each shard cut where the LR changes, at group boundaries
            offset = 0
            for flag, run in itertools.groupby(decoupled[storage // GROUP:(storage + hi - lo) // GROUP].tolist()):
                n = len(list(run)) * GROUP
                launches.append((bucket, lo + offset, storage + offset, n, flag))
                offset += n
        return launches


def _rounding_name(frag: Fragment, group_rank: Callable[[str], int]) -> str:
    """Every holder of the same values draws the same bits: TP-replicated parameters (norms) are salted by name only,
    so their TP copies stay identical; the last stage's copy of a tied embedding uses the embedding's name (what
    checkpoints call it). Shards of one tensor are salted apart by their rank in the group splitting it (``@tp1``)."""
    placement = placement_of(frag.param)
    name = "embedding.weight" if placement.tied_copy else frag.name
    return f"{name}@{placement.shard_group}{group_rank(placement.shard_group)}" if placement.sharded else name


def _group_rank(ddp: DistributedDataParallel) -> Callable[[str], int]:
    """This rank's index in a named group of the DDP's parallel state."""
    return lambda name: ddp.parallel_state.group(name).rank


def _counts_in_grad_norm(param: nn.Parameter, group_rank: Callable[[str], int]) -> bool:
    """Each element once, as its placement says: on every rank of the group splitting it, on the first rank of the
    group copying it (TP rank 0 for a norm weight), never for a tied embedding's pipeline copy."""
    return placement_of(param).counts_in_grad_norm(group_rank)
