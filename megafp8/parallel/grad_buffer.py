"""The data-parallel buffer layout (megafp8.parallel.data_parallel): buckets of one flat buffer per (grad-sync group,
dtype), 128-aligned, and the bytes of a bucket's low-precision weights, sized and addressed in bytes."""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from megafp8.parallel.collectives import GroupHandle
from megafp8_kernels import element_format

ALIGN = 128  # elements; also the optimizer's codec group size
BYTE_BITS = 8


def fp8_bits(dtype: torch.dtype) -> int:
    """Bits per element of the low-precision format stored as ``dtype`` (a packed one holds several per byte)."""
    return element_format(dtype).bits


def packed_shape(shape: torch.Size, bits: int) -> tuple[int, ...]:
    """The byte shape of a weight of ``shape`` in a format of ``bits`` per element (packed along the last dim)."""
    return (*shape[:-1], shape[-1] * bits // BYTE_BITS)


@dataclass(eq=False)
class Bucket:
    """A contiguous range ``[offset, offset + numel)`` of the grad buffer and its parameters."""

    index: int
    params: list[nn.Parameter]
    offset: int
    numel: int
    ranges: dict[nn.Parameter, tuple[int, int]]  # param -> [start, end) relative to the bucket
    grad_data: torch.Tensor
    param_data: torch.Tensor | None  # high-precision values (None for a released FP8 bucket)
    fp8: bool = False                # weights of FP8 layers, gathered as FP8 bytes
    fp8_data: torch.Tensor | None = None  # uint8, the gathered FP8 bytes (FP8 buckets): fp8_bytes(numel) of them
    fp8_grad: bool = False           # weights of FP8 layers, grads reduce-scattered as FP8 (--fp8-grad-reduce)
    ready: dict = field(default_factory=dict)  # param -> backward passes seen this iteration
    deferred: bool = False  # holds a tied-embedding copy: reduced in finish_grad_sync, not in backward
    grad_work: object = None  # the DP reduction in flight; its wait() gives this rank's reduced shard
    fp8_grad_segments: tuple | None = None  # (segment id per 128-group, count): one FP8 scale per param per shard
    param_work: object = None
    param_sync_pending: bool = False
    group: GroupHandle | None = None  # its grad-sync group: reduces its grads, gathers its values, holds its shards
    fp8_bits: int = BYTE_BITS         # bits per element of its weights' format in fp8_data

    def shard_range(self, dp_rank: int, dp_size: int, distributed: bool) -> tuple[int, int]:
        """The part of this bucket the given DP rank owns (all of it without the distributed optimizer)."""
        if not distributed:
            return 0, self.numel
        size = self.numel // dp_size
        return dp_rank * size, (dp_rank + 1) * size

    def fp8_bytes(self, elements: int) -> int:
        """Where element ``elements`` starts in fp8_data (or how many bytes that many elements take): whole bytes at
        every parameter and shard boundary, which sit on 128-element boundaries."""
        return -(-elements * self.fp8_bits // BYTE_BITS)

    def fp8_slice(self, start: int, end: int) -> torch.Tensor:
        """The bytes of elements ``[start, end)`` in fp8_data."""
        return self.fp8_data[self.fp8_bytes(start):self.fp8_bytes(end)]


def align(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_layouts(params: list[nn.Parameter], kind: Callable[[nn.Parameter], Hashable], bucket_size: int | None,
                   group_size: int) -> list[tuple[list[nn.Parameter], int, int, dict]]:
    """(params, offset, numel, ranges) of each bucket of one buffer: parameters in reverse order (backward finishes
    the last layers first), a new bucket where ``kind`` changes or the bucket reached ``bucket_size`` elements; each
    parameter starts on an ALIGN boundary and each bucket is padded to ALIGN x ``group_size`` (its shards stay whole
    groups)."""
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_numel = 0
    for p in reversed(params):
        if current and (kind(p) != kind(current[0]) or (bucket_size is not None and current_numel >= bucket_size)):
            groups.append(current)
            current, current_numel = [], 0
        current.append(p)
        current_numel += align(p.numel(), ALIGN)
    if current:
        groups.append(current)
    layouts, offset = [], 0
    for group in groups:
        ranges, cursor = {}, 0
        for p in group:
            ranges[p] = (cursor, cursor + p.numel())
            cursor = align(cursor + p.numel(), ALIGN)
        numel = align(cursor, ALIGN * group_size)
        layouts.append((group, offset, numel, ranges))
        offset += numel
    return layouts


def param_piece_segments(bucket: Bucket, dp_size: int) -> tuple[torch.Tensor, int]:
    """Segment ``piece * P + k`` for the 128-groups of parameter ``k`` (and the padding after it) in DP piece
    ``piece``: parameters start on group boundaries and pieces end on them, so no group straddles two."""
    starts = torch.tensor([bucket.ranges[p][0] for p in bucket.params]) // ALIGN
    groups = torch.arange(bucket.numel // ALIGN)
    param_of_group = torch.searchsorted(starts, groups, right=True) - 1
    piece_of_group = groups // (bucket.numel // ALIGN // dp_size)
    segments = piece_of_group * len(bucket.params) + param_of_group
    return segments.to(bucket.grad_data.device), dp_size * len(bucket.params)
