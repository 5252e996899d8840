"""torch.distributed.checkpoint (DCP) directories read with no code from their files able to run.

DCP unpickles ``.metadata`` with plain ``pickle`` and byte items with ``torch.load(weights_only=False)``, and the
manifest's SHA-256 guards against damage, not against whoever published a checkpoint. Here ``.metadata`` goes
through the restricted unpickler that also builds DCP's metadata records (Megatron's ``torch_dist`` reader uses it
too), byte items through ``weights_only=True`` plus numpy's array rebuilders, and a file that is not what megafp8
writes is one ``CheckpointError`` naming it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.futures import Future

from megafp8.checkpoint import safe_unpickler
from megafp8.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"


def _dcp_metadata_classes() -> dict[str, Any]:
    """The plain dataclasses and enums torch pickles into ``.metadata`` (which ones varies a little by version)."""
    names = {dcp_metadata: ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
             dcp_filesystem: ("_StorageInfo",),
             dcp_planner: ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")}
    classes = {f"{module.__name__}.{name}": getattr(module, name)
               for module, module_names in names.items() for name in module_names if hasattr(module, name)}
    # StorageMeta.checkpoint_id is the Path the writer was given: a pure path (no file access) stands in for it
    for kind, pure in (("Posix", pathlib.PurePosixPath), ("Windows", pathlib.PureWindowsPath)):
        for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes
            classes[f"{module}.{kind}Path"] = classes[f"{module}.Pure{kind}Path"] = pure
    return classes


_DCP_CLASSES = _dcp_metadata_classes()


class MetadataUnpickler(safe_unpickler.Unpickler):
    """The restricted unpickler that also builds torch's DCP metadata records (data holders, no behaviour).

    ``strict``: any other name the file holds is an error rather than an inert placeholder (megafp8's own
    ``.metadata`` never holds one; Megatron's may hold its own classes)."""

    def __init__(self, file: IO[bytes], *, strict: bool = False) -> None:
        super().__init__(file)
        self.strict = strict

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_CLASSES.get(f"{module}.{name}")
        if found is None:
            found = super().find_class(module, name)
            if self.strict and isinstance(found, type) and issubclass(found, safe_unpickler.Placeholder):
                raise pickle.UnpicklingError(f"it names {found.qualified_name}, which a checkpoint index never "
                                             "holds; nothing from the file was run")
            return found
        self.globals_found.add(id(found))
        return found


def _check_metadata(metadata: Any) -> dcp_metadata.Metadata:
    """``metadata`` if it has the shape DCP and megafp8 rely on (so a crafted file fails here, not deep in DCP)."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"it holds a {type(metadata).__name__}, not PyTorch distributed-checkpoint metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise ValueError("its entry or storage tables are not dicts")
    for key, entry in entries.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            chunks_ok = isinstance(entry.chunks, list) and all(
                isinstance(c, dcp_metadata.ChunkStorageMetadata) for c in entry.chunks)
            if not (isinstance(entry.properties, dcp_metadata.TensorProperties) and
                    isinstance(entry.properties.dtype, torch.dtype) and isinstance(entry.size, tuple) and chunks_ok):
                raise ValueError(f"tensor entry {key!r} is malformed")
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            raise ValueError(f"entry {key!r} is a {type(entry).__name__}")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise ValueError("a storage record is malformed")
        name = info.relative_path
        # DCP joins this to the checkpoint directory: only a file inside it is one megafp8 wrote
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"entry {index.fqn!r} points at {name!r}, outside the checkpoint directory")
        if not isinstance(info.offset, int) or not isinstance(info.length, int) or min(info.offset, info.length) < 0:
            raise ValueError(f"entry {index.fqn!r} has a malformed offset or length")
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"entry {index.fqn!r} is stored with transforms {info.transform_descriptors!r} "
                             "(compression or encryption), which megafp8 never writes")
    if not isinstance(getattr(metadata, "storage_meta", None), (dcp_metadata.StorageMeta, type(None))):
        raise ValueError("its storage_meta is malformed")
    return metadata


def read_metadata(directory: Path) -> dcp_metadata.Metadata:
    """``directory/.metadata`` of a megafp8 checkpoint, through the strict restricted unpickler; anything else
    raises one CheckpointError naming the file."""
    file = Path(directory) / METADATA_FILE
    try:
        with open(file, "rb") as stream:
            return _check_metadata(MetadataUnpickler(stream, strict=True).load())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # noqa: BLE001 - whatever the unpickler met, the file is the cause
        reason = str(e) if isinstance(e, (ValueError, pickle.UnpicklingError)) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{file} is corrupt or unreadable ({reason})") from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose ``.metadata`` goes through ``read_metadata`` (DCP's own uses plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: dcp_planner.LoadPlan, planner: dcp_planner.LoadPlanner) -> Future[None]:
        # DCP's error for an item that fails to load names no file: read file by file, so the error can
        by_file: dict[str, list[dcp_planner.ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:  # a byte item the planner refused: its message names the file already
                raise
            except Exception as e:  # noqa: BLE001 - a chunk that does not load means the file is not ours
                reason = re.sub(r"\s+", " ", _weights_only_reason(e))
                raise CheckpointError(f"{Path(self.path) / name} is corrupt or not what megafp8 writes "
                                      f"({type(e).__name__}: {reason})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def entry_source(directory: Path, metadata: dcp_metadata.Metadata | None, index: dcp_metadata.MetadataIndex) -> str:
    """``DIR/__0_0.distcp (entry 'rng.rank00000')``: where an entry's bytes lie, for messages."""
    info = metadata.storage_data.get(index) if metadata is not None else None
    return f"{Path(directory) / info.relative_path if info is not None else directory} (entry {index.fqn!r})"


def _numpy_globals() -> list[Any]:
    """What ``np.random.get_state()`` (an ndarray, its dtype) and numpy scalars pickle as. Each rebuilds an array
    or a dtype from plain values; both names of numpy's core module (``numpy.core`` before 2.0, ``numpy._core``
    after) are allowed so that a state saved under either numpy loads under the other."""
    reconstruct, scalar = np.zeros(1).__reduce__()[0], np.int64(0).__reduce__()[0]
    found = [np.ndarray, np.dtype, *{type(np.dtype(t)) for t in set(np.sctypeDict.values())}]
    for function, name in ((reconstruct, "_reconstruct"), (scalar, "scalar")):
        found += [(function, f"{core}.multiarray.{name}") for core in ("numpy.core", "numpy._core")]
    return found


_NUMPY_GLOBALS = _numpy_globals()


@contextlib.contextmanager
def _allow_numpy() -> Iterator[None]:
    # safe_globals removes what it added on exit: hand it only what the user has not allowed already
    present = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([g for g in _NUMPY_GLOBALS if g not in present]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error below says all there is
        yield


def _weights_only_reason(error: BaseException) -> str:
    """The line of torch's weights_only message that says what the file held (the rest is boilerplate)."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(boilerplate)]
    return (useful[0] if useful else lines[-1] if lines else type(error).__name__).rstrip(".")


def _load_weights_only(data: bytes | IO[bytes]) -> Any:
    """``torch.load(weights_only=True)`` of a blob; a ValueError with torch's one useful line if it is not plain."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with _allow_numpy():
            return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load met, the bytes are the cause
        raise ValueError(re.sub(r"\s+", " ", _weights_only_reason(e))) from None


def load_plain(data: bytes | IO[bytes], source: str) -> Any:
    """A ``torch.save`` blob of plain data (python values, tensors, numpy arrays) with ``weights_only=True``:
    a pickle that names anything else raises one CheckpointError naming ``source``, before it can run."""
    try:
        return _load_weights_only(data)
    except ValueError as e:
        raise CheckpointError(f"{source} is corrupt or not plain data: {e} (nothing from it was run)") from None


def check_plain(data: bytes, what: str) -> None:
    """The save side of ``load_plain``: a value that would not load back fails the save, not a later resume."""
    try:
        _load_weights_only(data)
    except ValueError as e:
        raise CheckpointError(f"{what} would not load back from a checkpoint ({e}): save only python values, "
                              "tensors and numpy arrays") from None
