"""Pieces of one global tensor at global offsets, in the form torch.distributed.checkpoint (DCP) saves and loads.

A rank hands DCP a ``ShardedChunks`` per sharded tensor: the global shape plus (global offsets, local
view) pairs. On save, DCP writes each chunk with its offsets and dedups chunks that several ranks hold
(data-parallel replicas); on load, DCP reads, for every local chunk, the overlapping parts of whatever
chunks were saved and copies them into the local view in place. That is the whole resharding story:
a tensor saved at one TP/PP/DP layout loads at any other because only global coordinates are stored.

Why not DTensor: DCP cannot express a rank owning two disjoint pieces of one tensor through a DTensor
(the fused gate/up weight at ``partition_stride`` 2, or a ZeRO range that crosses rows), and
``_StridedShard`` saves wrong chunk metadata in torch <= 2.13 (transformers documents the same bug).
DCP's ``_Checkpointable`` protocol (``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__``) states the chunks explicitly, needs no DeviceMesh and no collective to build,
and works the same with gloo on CPU and NCCL on GPU. The two planner subclasses below teach DCP's default
planners to look these objects up (their documented extension points), and keep byte items (python values) to
plain data: DCP's default loads them with ``weights_only=False``, which would run code from the file.

Constructors for the three kinds of sharded state in megafp8:
- ``tensor_parallel_state``: a shard of a parameter whose placement (megafp8.parallel.placement) splits it over a
  group (TP for every tagged one today), or any tensor of the shard's shape (non-ZeRO optimizer moments);
  vocab-padded rows are left out so the global shape is layout-free. Only a parameter placed whole is saved as
  one replicated tensor: a split one whose group's coordinates are unknown fails instead of losing its other pieces.
- ``param_flat_range_state``: a rank's ZeRO range [start, start + n) of a parameter's flattened TP shard,
  saved in the parameter's global shape (so it reshards over TP *and* DP).
- ``flat_range_state`` / ``flat_sharded_state``: a 1-D tensor owned in ranges (global offset, numel).
"""
from __future__ import annotations

import io
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType

from megafp8.checkpoint.safe_dcp import check_plain, entry_source, load_plain
from megafp8.parallel.placement import placement_of, shard_coords

# group name -> (this rank's index, size), as ParallelState.group_coordinates() gives them
GroupCoords = Mapping[str, tuple[int, int]]


class ShardedChunks:
    """This rank's chunks of a tensor of ``global_shape``: ``(global offsets, local tensor)`` pairs.

    The local tensors are views into the live state (parameters, optimizer buffers), so a DCP load
    writes straight into them. Empty chunks are dropped; a rank may hold none.
    """

    def __init__(self, global_shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], torch.Tensor]],
                 dtype: torch.dtype | None = None) -> None:
        self.global_shape = torch.Size(global_shape)
        self.chunks: list[tuple[torch.Size, torch.Tensor]] = []
        for offsets, tensor in chunks:
            offsets = torch.Size(offsets)
            if len(offsets) != len(self.global_shape) or tensor.dim() != len(self.global_shape):
                raise ValueError(f"ShardedChunks: chunk of shape {tuple(tensor.shape)} at {tuple(offsets)} does not "
                                 f"match the rank of global shape {tuple(self.global_shape)}")
            if any(o < 0 or o + s > g for o, s, g in zip(offsets, tensor.shape, self.global_shape)):
                raise ValueError(f"ShardedChunks: chunk of shape {tuple(tensor.shape)} at {tuple(offsets)} lies "
                                 f"outside global shape {tuple(self.global_shape)}")
            if tensor.numel():
                self.chunks.append((offsets, tensor))
        dtypes = {t.dtype for _, t in self.chunks}
        if len(dtypes) > 1:
            raise ValueError(f"ShardedChunks: chunks of one tensor must share a dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else (dtype or torch.get_default_dtype())

    def size(self) -> torch.Size:
        """The global size (DCP compares it with the saved size before loading)."""
        return self.global_shape

    def __repr__(self) -> str:
        return f"ShardedChunks(global_shape={tuple(self.global_shape)}, chunks={[tuple(o) for o, _ in self.chunks]})"

    # -- DCP's _Checkpointable protocol --------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape),
                                                      properties=TensorProperties.create_from_tensor(tensor),
                                                      size=self.global_shape))
                for offsets, tensor in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape) for offsets, tensor in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks) and self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for offsets, tensor in self.chunks:
            if offsets == index.offset:
                return tensor
        raise ValueError(f"no local chunk of {index.fqn} at offsets {tuple(index.offset or ())}")


class ShardedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, able to look up ``ShardedChunks`` chunks; a python value that would not load
    back as plain data (``ShardedLoadPlanner`` refuses anything else) fails the save, naming its key."""

    def lookup_object(self, index: MetadataIndex) -> object:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardedChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        data = super().transform_object(write_item, object)
        if write_item.type == WriteItemType.BYTE_IO:
            check_plain(data.getvalue(), f"checkpoint entry {write_item.index.fqn!r}")
        return data


class ShardedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, able to look up ``ShardedChunks`` chunks, and loading byte items as plain
    data only (``load_plain``); ``checkpoint_dir``: the directory read, for messages."""

    def __init__(self, *args: Any, checkpoint_dir: str | Path | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else Path(".")

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # The default first runs _init_state_dict (materializing meta tensors), which replaces every leaf
        # type it does not know, ShardedChunks included, by None. megafp8 never loads into meta tensors.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardedChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        source = entry_source(self.checkpoint_dir, self.metadata, read_item.storage_index)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], load_plain(value, source))


# ---- how megafp8's shards map to global coordinates -----------------------------------------------

def _flat_range_boxes(shape: Sequence[int], start: int, end: int) -> Iterator[tuple[list[int], list[int], int]]:
    """Split the row-major flat range [start, end) of ``shape`` into boxes ``(offsets, sizes, flat_start)``,
    each a contiguous run of the flat order (a 2-D range gives at most 3: a partial row, whole rows, a
    partial row)."""
    if start >= end:
        return
    if len(shape) <= 1:
        yield [start] if shape else [], [end - start] if shape else [], start
        return
    inner = math.prod(shape[1:])
    row = start // inner
    if start % inner:  # a partial first row
        row_end = min(end, (row + 1) * inner)
        for offsets, sizes, flat in _flat_range_boxes(shape[1:], start - row * inner, row_end - row * inner):
            yield [row, *offsets], [1, *sizes], flat + row * inner
        start, row = row_end, row + 1
    whole_rows = (end - start) // inner if start < end else 0
    if whole_rows:
        yield [row, *[0] * (len(shape) - 1)], [whole_rows, *shape[1:]], start
        start, row = start + whole_rows * inner, row + whole_rows
    if start < end:  # a partial last row
        for offsets, sizes, flat in _flat_range_boxes(shape[1:], 0, end - start):
            yield [row, *offsets], [1, *sizes], flat + row * inner


def _shard_layout(param: torch.Tensor, tp_rank: int, tp_size: int, vocab_size: int | None,
                  group_coords: GroupCoords | None) -> tuple[list[int], int | None, int, int, int | None, int, int]:
    """(global shape, partition dim, local block size, stride, kept extent along the vocab dim, rank, size in the
    group splitting it) as the parameter's placement says."""
    shape, placement = list(param.shape), placement_of(param)
    if not placement.sharded:
        return shape, None, 0, 1, None, 0, 1
    rank, size = shard_coords(placement, tp_rank, tp_size, group_coords)
    dim, stride = placement.shard_dim, placement.shard_stride
    if shape[dim] % stride:
        raise ValueError(f"a shard of size {shape[dim]} along dim {dim} does not split into {stride} stride blocks")
    shape[dim] *= size
    keep = None
    if placement.padded_vocab and vocab_size is not None:
        if vocab_size > shape[dim]:
            raise ValueError(f"vocab size {vocab_size} exceeds the padded vocab ({shape[dim]}) of a parameter")
        shape[dim] = keep = vocab_size  # padding rows depend on TP: they are not part of the checkpoint
    return shape, dim, param.shape[dim] // stride, stride, keep, rank, size


def _to_global(box_offsets: list[int], box: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int,
               vocab_size: int | None, group_coords: GroupCoords | None
               ) -> tuple[list[int], list[tuple[list[int], torch.Tensor]]]:
    """Map a box of ``param``'s local shard (local offsets + its data) to global chunks."""
    global_shape, dim, block, stride, keep, rank, size = _shard_layout(param, tp_rank, tp_size, vocab_size,
                                                                       group_coords)
    if dim is None:
        return global_shape, [(box_offsets, box)]
    full_block = block * size
    chunks = []
    lo, hi = box_offsets[dim], box_offsets[dim] + box.shape[dim]
    while lo < hi:  # split at stride-block boundaries: each block lands in a different global region
        b = lo // block
        piece_end = min(hi, (b + 1) * block)
        g_lo = b * full_block + rank * block + (lo - b * block)
        g_hi = g_lo + piece_end - lo
        if keep is not None:
            g_hi = min(g_hi, keep)
        if g_hi > g_lo:
            offsets = list(box_offsets)
            offsets[dim] = g_lo
            chunks.append((offsets, box.narrow(dim, lo - box_offsets[dim], g_hi - g_lo)))
        lo = piece_end
    return global_shape, chunks


def tensor_parallel_state(local: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int,
                          vocab_size: int | None = None, *, group_coords: GroupCoords | None = None
                          ) -> torch.Tensor | ShardedChunks:
    """``local`` (a shard of ``param``, or a tensor of the shard's shape such as an Adam moment) in global
    coordinates. A tensor whose placement keeps it whole is returned as it is: DCP saves it once.

    ``vocab_size``: the real vocab; rows of vocab-padded tensors at or past it are not saved. ``group_coords``: this
    rank's (index, size) per group, for parameters split over a group other than TP (``tp_rank``/``tp_size``)."""
    if local.shape != param.shape:
        raise ValueError(f"tensor_parallel_state: local tensor {tuple(local.shape)} is not shaped like its "
                         f"parameter shard {tuple(param.shape)}")
    if not placement_of(param).sharded:
        return local
    global_shape, chunks = _to_global([0] * local.dim(), local, param, tp_rank, tp_size, vocab_size, group_coords)
    return ShardedChunks(global_shape, chunks, dtype=local.dtype)


def param_flat_range_state(local_flat: torch.Tensor, flat_start: int, param: torch.Tensor, tp_rank: int,
                           tp_size: int, vocab_size: int | None = None, *,
                           group_coords: GroupCoords | None = None) -> ShardedChunks:
    """A ZeRO shard: ``local_flat`` holds elements [flat_start, flat_start + n) of ``param``'s flattened
    local shard; it is saved in ``param``'s global shape, so it reloads under another TP *and* DP
    size (a template built the same way at the new layout receives its new range)."""
    if local_flat.dim() != 1:
        raise ValueError(f"param_flat_range_state: expected a 1-D range, got shape {tuple(local_flat.shape)}")
    end = flat_start + local_flat.numel()
    if flat_start < 0 or end > param.numel():
        raise ValueError(f"param_flat_range_state: range [{flat_start}, {end}) outside the shard's "
                         f"{param.numel()} elements")
    global_shape = _shard_layout(param, tp_rank, tp_size, vocab_size, group_coords)[0]
    chunks = []
    for offsets, sizes, flat in _flat_range_boxes(list(param.shape), flat_start, end):
        box = local_flat[flat - flat_start: flat - flat_start + math.prod(sizes)].view(sizes)
        chunks += _to_global(offsets, box, param, tp_rank, tp_size, vocab_size, group_coords)[1]
    return ShardedChunks(global_shape, chunks, dtype=local_flat.dtype)


def flat_range_state(local: torch.Tensor, global_offset: int, global_numel: int) -> ShardedChunks:
    """A 1-D tensor of ``global_numel`` elements of which this rank owns [global_offset, + local.numel())."""
    if local.dim() != 1:
        raise ValueError(f"flat_range_state: expected a 1-D tensor, got shape {tuple(local.shape)}")
    return ShardedChunks([global_numel], [([global_offset], local)], dtype=local.dtype)


def flat_sharded_state(entries: Mapping[str, tuple[torch.Tensor, int, int]]) -> dict[str, ShardedChunks]:
    """``{name: (local 1-D tensor, global offset, global numel)}`` as DCP-saveable chunks; the same call on
    the loading side (new ranges, destination tensors) receives the re-sliced values in place."""
    return {name: flat_range_state(local, offset, numel) for name, (local, offset, numel) in entries.items()}
