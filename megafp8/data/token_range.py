"""Token ids checked against the tokenizer's vocabulary before training.

An id past the vocabulary would not fail where users see it: at TP >= 2 the vocab-parallel embedding and
cross-entropy mask it to row 0, and ids that land in the embedding's padding rows train at any TP. So each data
prefix's smallest and largest id are read once from its .bin (in chunks) and the verdict is cached beside the index
arrays, keyed by the dataset's fingerprint (its .idx bytes and .bin size): a later start reads a small JSON file.
"""
from __future__ import annotations

import json
import os

from megafp8.data.index_cache import dataset_fingerprint
from megafp8.data.indexed_dataset import IndexedDataset

CACHE_KIND = "token-range"


def token_id_range(prefix: str, cache_dir: str | None) -> tuple[int, int]:
    """(smallest, largest) token id of ``prefix``'s .bin, from the cache when its fingerprint matches."""
    fingerprint = dataset_fingerprint(prefix)
    path = os.path.join(cache_dir, f"{fingerprint[:20]}-{CACHE_KIND}.json") if cache_dir else None
    if path is not None:
        try:
            with open(path) as f:
                cached = json.load(f)
            if cached.get("fingerprint") == fingerprint:
                return int(cached["min"]), int(cached["max"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing or damaged: read the data again
    low, high = IndexedDataset(prefix).token_id_range()
    if path is not None:
        try:  # atomic, and an unwritable cache directory only costs another scan next time
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"fingerprint": fingerprint, "prefix": os.path.abspath(prefix), "min": low, "max": high}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            pass
    return low, high


def token_range_error(prefix: str, vocab_size: int, cache_dir: str | None) -> str | None:
    """One line naming the prefix and the offending id when some id is outside [0, vocab_size), else None."""
    low, high = token_id_range(prefix, cache_dir)
    if high < 0:
        return None
    if low < 0:
        return f"--data-path {prefix}: token id {low} is negative; the data is not what the tokenizer writes"
    if high >= vocab_size:
        return (f"--data-path {prefix}: token id {high} is past the tokenizer's vocabulary ({vocab_size} ids: 0 .. "
                f"{vocab_size - 1}); was it preprocessed with another tokenizer or --vocab-size?")
    return None
