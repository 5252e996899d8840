"""On-disk cache of derived index arrays (.npy), keyed by everything they were built from.

The cache key hashes a description that includes a content fingerprint of the dataset's ``.idx`` and the
size of its ``.bin`` plus every build parameter, so a changed input or parameter yields a different key
and a rebuild: a stale cache can never be loaded. Files are written under temporary names, fsync'd and renamed,
description last, so a reader sees a complete entry or none (several ranks may build the same entry); each array's
SHA-256 is kept beside it and checked on load, so a damaged array is rebuilt, not trained on.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from functools import lru_cache
from typing import Sequence

import numpy as np

from megafp8.data.indexed_dataset import bin_path, idx_path


@lru_cache(maxsize=256)
def _fingerprint(path_prefix: str, idx_mtime_ns: int, idx_size: int, bin_size: int) -> str:
    digest = hashlib.sha256()
    with open(idx_path(path_prefix), "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    digest.update(str(bin_size).encode())
    return digest.hexdigest()


def dataset_fingerprint(path_prefix: str) -> str:
    """SHA-256 of the .idx bytes and the .bin size (memoized while the files are unchanged).

    The .idx holds every sequence length, so any re-tokenization changes it; hashing the (much larger)
    .bin as well would cost seconds per GB on every start for little extra safety.
    """
    index = os.stat(idx_path(path_prefix))
    return _fingerprint(os.path.abspath(path_prefix), index.st_mtime_ns, index.st_size,
                        os.path.getsize(bin_path(path_prefix)))


class IndexCache:
    """A set of named arrays stored as ``{dir}/{key}-{kind}-{name}.npy`` plus ``{key}-{kind}-description.json``."""

    def __init__(self, cache_dir: str | None, kind: str, description: dict) -> None:
        self.cache_dir = cache_dir
        self.kind = kind
        self.description = json.dumps(description, sort_keys=True, indent=1)
        self.key = hashlib.sha256(self.description.encode()).hexdigest()[:20]

    def _path(self, name: str) -> str:
        return os.path.join(self.cache_dir, f"{self.key}-{self.kind}-{name}")

    def load(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The cached arrays (memory-mapped), or None on a miss."""
        if self.cache_dir is None:
            return None
        description_path = self._path("description.json")
        paths = {name: self._path(f"{name}.npy") for name in names}
        if not os.path.isfile(description_path) or not all(map(os.path.isfile, paths.values())):
            return None
        with open(description_path, encoding="utf-8") as f:
            if f.read() != self.description:  # a hash collision, or a hand-edited cache: rebuild
                return None
        # The arrays decide which tokens train: one that is not byte for byte what was written (a file of zeros, a
        # truncated write, shifted offsets) is rebuilt, never trusted.
        try:
            with open(self._path("checksums.json"), encoding="utf-8") as f:
                checksums = json.load(f)
            damaged = [path for name, path in paths.items() if _sha256(path) != checksums.get(name)]
            arrays = {} if damaged else {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
        except (OSError, ValueError, EOFError) as exc:
            damaged, arrays = [f"{self.cache_dir} ({type(exc).__name__}: {exc})"], {}
        if damaged:
            warnings.warn(f"index cache {damaged[0]} is damaged or incomplete: rebuilding it (if this repeats, "
                          f"delete {self.cache_dir})")
            return None
        return arrays

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Write the arrays atomically; an unwritable cache directory only costs a rebuild next time."""
        if self.cache_dir is None:
            return
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            checksums = {}
            for name, array in arrays.items():
                path = self._path(f"{name}.npy")
                _write_durably(path, lambda f, array=array: np.save(f, array, allow_pickle=False))
                checksums[name] = _sha256(path)
            _write_durably(self._path("checksums.json"), lambda f: f.write(json.dumps(checksums).encode()))
            # The description last: a reader that finds it finds every array and its checksum complete.
            _write_durably(self._path("description.json"), lambda f: f.write(self.description.encode()))
        except OSError as exc:
            warnings.warn(f"could not write the index cache in {self.cache_dir} ({exc}); indices stay in memory")


def _write_durably(path: str, write) -> None:
    """``write(f)`` into a temporary file, fsync'd before it is renamed into place (a crash leaves the old file or
    the new one, never a renamed empty one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def array_state(array: np.ndarray):
    """Pickle form of an index array: the .npy path when it is mapped from the cache, else the array.

    Data-loader workers receive datasets by pickle, and pickling a np.memmap copies all of its pages.
    """
    if isinstance(array, np.memmap) and array.filename:
        return ("npy", array.filename)
    return array


def restore_array(state) -> np.ndarray:
    if isinstance(state, tuple) and state and state[0] == "npy":
        return np.load(state[1], mmap_mode="r")
    return state
