"""A weight of an FP8 layer that the saturation guard moved to high precision under --fp8-param-gather: it
leaves the FP8 gather and gets a high-precision DP all-gather of its own, beside its unchanged FP8 bucket."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle

if TYPE_CHECKING:
    from megafp8.parallel.data_parallel import Bucket


@dataclass(eq=False)
class SwitchedWeight:
    """Its bucket keeps its FP8 layout (the grad buffer, the optimizer's shards and every other weight stay
    where they are); its high-precision values travel in an all-gather of their own, one per publish, in
    which each DP rank sends its owned piece padded to the longest piece (``piece_numel``). ``weight`` is the
    whole weight (``param.data`` views it); ``shard`` is this rank's padded piece, written by the optimizer.
    """

    param: nn.Parameter
    bucket: Bucket
    pieces: list[tuple[int, int]]  # per DP rank: the [lo, hi) of the flat weight it owns (may be empty)
    owned_bucket_lo: int           # where this rank's piece starts in the bucket
    shard: torch.Tensor
    weight: torch.Tensor
    pending: bool = False  # the shard holds values not gathered yet
    work: object = None

    @classmethod
    def take(cls, param: nn.Parameter, bucket: Bucket, dp: GroupHandle) -> SwitchedWeight:
        """Move `param` off its bucket's FP8 path: a whole high-precision weight becomes ``param.data``."""
        start, end = bucket.ranges[param]
        pieces = []
        for r in range(dp.size):
            lo, hi = bucket.shard_range(r, dp.size, True)
            lo, hi = max(start, lo), min(end, hi)
            pieces.append((lo - start, hi - start) if lo < hi else (0, 0))
        device = bucket.grad_data.device
        weight = torch.zeros(param.shape, dtype=param.dtype, device=device)
        shard = torch.zeros(max(hi - lo for lo, hi in pieces), dtype=param.dtype, device=device)
        param.data = weight
        if bucket.fp8_data is not None:
            bucket.fp8_slice(start, end).zero_()  # still gathered with the bucket, never read again
        return cls(param, bucket, pieces, start + pieces[dp.rank][0], shard, weight)

    @property
    def piece_numel(self) -> int:
        return self.shard.numel()

    def start_gather(self, dp: GroupHandle) -> None:
        if self.pending and self.work is None:
            gathered = torch.empty(dp.size * self.piece_numel, dtype=self.shard.dtype, device=self.shard.device)
            self.work = C.all_gather_into_tensor_async(gathered, self.shard, dp, "dp_param_allgather")

    def finish_gather(self, dp: GroupHandle) -> None:
        if not self.pending:
            return
        self.start_gather(dp)
        gathered, flat = self.work.wait(), self.weight.view(-1)
        for r, (lo, hi) in enumerate(self.pieces):
            flat[lo:hi].copy_(gathered[r * self.piece_numel:r * self.piece_numel + hi - lo])
        self.work, self.pending = None, False
