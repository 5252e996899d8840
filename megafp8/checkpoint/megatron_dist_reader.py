"""Megatron-Core ``torch_dist`` checkpoints (PyTorch DCP files under Megatron's sharded-tensor keys) read without
Megatron, and without running code from the files.

An ``iter_N/`` directory holds ``.metadata`` (a pickle naming every entry: each tensor's global shape and the
chunks each rank wrote, each byte entry, where they lie in the ``*.distcp`` files), the ``*.distcp`` files (each
entry a ``torch.save`` blob) and, from Megatron-Core's ``dist_checkpointing.save`` up to 0.16, ``common.pt`` (the
non-sharded state: ``args``, ``iteration``, ...); newer Megatron saves that common state as one more byte entry,
``common_state/shard_...``. Every pickle here goes through a restricted unpickler (``safe_unpickler``, plus
torch's own DCP metadata dataclasses for ``.metadata``: ``safe_dcp.MetadataUnpickler``): Megatron's classes become
inert placeholders. A tensor is read chunk by chunk into the region asked for (one layer of a tensor stacked over
layers reads only that layer's chunks), so nothing is ever assembled beyond what is written next.
"""
from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from megafp8.checkpoint import safe_unpickler
from megafp8.checkpoint.hf_files import ConversionError
from megafp8.checkpoint.safe_dcp import METADATA_FILE, MetadataUnpickler

COMMON_FILE = "common.pt"
COMMON_STATE_KEY = "common_state"


def load_pickle_file(file: Path | IO[bytes], source: str) -> Any:
    """A ``torch.save`` file or blob through the restricted unpickler; one that is not one names ``source``."""
    try:
        return safe_unpickler.load(file)
    except OSError as e:
        raise ConversionError(f"cannot read {source}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the unpickler met, the file is the cause
        if not zipfile.is_zipfile(file):  # every torch.save since torch 1.6 writes a zip; its directory is last
            raise ConversionError(f"{source} is truncated or not a PyTorch checkpoint "
                                  f"({type(e).__name__}: {e})") from None
        raise ConversionError(f"{source} is a PyTorch checkpoint that cannot be read "
                              f"({type(e).__name__}: {e})") from None


def _truncated(file: Path, key: str, info: Any, size: int) -> ConversionError:
    return ConversionError(f"{file} is truncated: entry {key!r} needs bytes {info.offset}..{info.offset + info.length}"
                           f", the file ends at {size}")


def is_dist_checkpoint(path: Path) -> bool:
    """Whether the iteration directory ``path`` holds a DCP (``torch_dist``) checkpoint, complete or not."""
    return any(p.name in (METADATA_FILE, "metadata.json") or p.suffix == ".distcp" for p in path.iterdir())


class DistCheckpoint:
    """One ``torch_dist`` iteration directory: its entries by key, tensors readable whole or one layer at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata_file = path / METADATA_FILE
        self._check_backend()
        if not self.metadata_file.exists():
            files = "*.distcp files but " if any(path.glob("*.distcp")) else ""
            raise ConversionError(f"{path} has {files}no {METADATA_FILE}: the torch_dist save did not finish (its "
                                  "last step writes .metadata); use an earlier iteration")
        try:
            with open(self.metadata_file, "rb") as file:
                metadata = MetadataUnpickler(file).load()
        except Exception as e:  # noqa: BLE001 - a corrupt file can fail in many ways
            raise ConversionError(f"{self.metadata_file} is corrupt or truncated ({type(e).__name__}: {e})") from None
        entries = getattr(metadata, "state_dict_metadata", None)
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(entries, dict) or \
                not isinstance(storage, dict):
            raise ConversionError(f"{self.metadata_file} is not PyTorch distributed-checkpoint metadata")
        self.tensors: dict[str, dcp_metadata.TensorStorageMetadata] = {
            k: m for k, m in entries.items() if isinstance(m, dcp_metadata.TensorStorageMetadata)}
        self.objects = [k for k, m in entries.items() if isinstance(m, dcp_metadata.BytesStorageMetadata)]
        # (key, chunk offsets or None for a byte entry) -> where its bytes lie
        self._storage = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
                         for index, info in storage.items()}

    def _check_backend(self) -> None:
        config = self.path / "metadata.json"  # Megatron's backend record; plain DCP directories have none
        if not config.exists():
            return
        try:
            backend = json.loads(config.read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as e:
            raise ConversionError(f"{config} is corrupt ({type(e).__name__}: {e})") from None
        if backend != "torch_dist":
            raise ConversionError(f"{config}: sharded_backend {backend!r}; only Megatron's torch_dist format is "
                                  "read (re-save with --ckpt-format torch_dist, or convert to the legacy format)")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def _entry_bytes(self, key: str, offsets: tuple[int, ...] | None) -> tuple[bytes, str]:
        info = self._storage.get((key, offsets))
        if info is None:
            raise ConversionError(f"{self.metadata_file}: entry {key!r}" + (f" at {list(offsets)}" if offsets else "")
                                  + " has no storage record (the metadata is corrupt)")
        file = self.path / info.relative_path
        source = f"{file} (entry {key!r})"
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{source} is stored with transforms {list(info.transform_descriptors)} "
                                  "(compression or encryption), which this reader does not undo")
        try:
            with open(file, "rb") as stream:
                stream.seek(info.offset)
                data = stream.read(info.length)
        except OSError as e:
            raise ConversionError(f"cannot read {source}: {e}") from None
        if len(data) != info.length:
            raise _truncated(file, key, info, file.stat().st_size)
        return data, source

    def check_storage(self, keys: list[str]) -> None:
        """Every chunk of ``keys`` has a storage record inside its file (sizes only: a truncated or missing file
        is named before anything is read or written)."""
        sizes: dict[str, int] = {}
        for key in keys:
            for chunk in self.tensors[key].chunks:
                info = self._storage.get((key, tuple(chunk.offsets)))
                if info is None:
                    raise ConversionError(f"{self.metadata_file}: chunk {list(chunk.offsets)} of {key!r} has no "
                                          "storage record (the metadata is corrupt)")
                file = self.path / info.relative_path
                if info.relative_path not in sizes:
                    if not file.is_file():
                        raise ConversionError(f"{file} is missing (it holds {key!r}; the checkpoint is incomplete)")
                    sizes[info.relative_path] = file.stat().st_size
                if info.offset + info.length > sizes[info.relative_path]:
                    raise _truncated(file, key, info, sizes[info.relative_path])

    def load_object(self, key: str) -> Any:
        """A byte entry, unpickled through the restricted unpickler (Megatron stores a list of the objects)."""
        data, source = self._entry_bytes(key, None)
        return load_pickle_file(io.BytesIO(data), source)

    def _chunk(self, key: str, chunk: dcp_metadata.ChunkStorageMetadata) -> torch.Tensor:
        data, source = self._entry_bytes(key, tuple(chunk.offsets))
        tensor = load_pickle_file(io.BytesIO(data), source)
        dtype = self.tensors[key].properties.dtype
        is_tensor = isinstance(tensor, torch.Tensor)
        if not is_tensor or tuple(tensor.shape) != tuple(chunk.sizes) or tensor.dtype != dtype:
            found = f"{list(tensor.shape)} {tensor.dtype}" if is_tensor else type(tensor).__name__
            raise ConversionError(f"{source}: holds {found}, the metadata says {list(chunk.sizes)} {dtype}")
        return tensor

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor ``key``, or its slice ``[layer]`` along the first dim, from the chunks covering it."""
        size = self.shape(key)
        low, high = [0] * len(size), list(size)
        if layer is not None:
            low[0], high[0] = layer, layer + 1
        out = torch.empty([h - lo for lo, h in zip(low, high)], dtype=self.tensors[key].properties.dtype)
        covered = 0
        for chunk in self.tensors[key].chunks:
            start = [max(lo, o) for lo, o in zip(low, chunk.offsets)]
            stop = [min(h, o + s) for h, o, s in zip(high, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(start, stop)):
                continue
            source = self._chunk(key, chunk)[tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, chunk.offsets))]
            out[tuple(slice(a - lo, b - lo) for a, b, lo in zip(start, stop, low))] = source
            covered += math.prod(b - a for a, b in zip(start, stop))
        if covered != out.numel():
            raise ConversionError(f"{self.metadata_file}: the saved chunks of {key!r} cover {covered} of the "
                                  f"{out.numel()} elements" + (f" of layer {layer}" if layer is not None else "")
                                  + " (the checkpoint is incomplete)")
        return out[0] if layer is not None else out

    def common_state(self) -> dict[str, Any]:
        """The non-sharded state (``args``, ``iteration``, ...): ``common.pt``, else the ``common_state`` entry."""
        common_file = self.path / COMMON_FILE
        if common_file.exists():
            state = load_pickle_file(common_file, str(common_file))
        else:
            keys = [k for k in self.objects if k.split("/")[0] == COMMON_STATE_KEY]
            if not keys:
                raise ConversionError(f"{self.path} has neither {COMMON_FILE} nor a {COMMON_STATE_KEY!r} entry in "
                                      f"{METADATA_FILE}: the saved args that describe the model are missing")
            state = {}
            for key in keys:
                value = self.load_object(key)
                for part in value if isinstance(value, list) else [value]:  # Megatron saves [object]
                    if isinstance(part, dict):
                        state.update(part)
        if not isinstance(state, dict):
            raise ConversionError(f"{self.path}: the common state is a {type(state).__name__}, not a dict")
        return state

