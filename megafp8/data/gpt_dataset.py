"""GPT pretraining samples: ``seq_length + 1`` consecutive tokens cut across document boundaries.

Three index arrays, as in Megatron-LM's GPTDataset, define the samples:

    document index  the split's documents in a seeded order, one fresh permutation per epoch, tiled
                    over as many epochs as the requested sample count needs
    sample index    (num_samples + 1, 2): for sample i, the position (row in the document index,
                    token offset) of its first token; sample i is every token from row i up to and
                    including row i + 1, so consecutive samples share one token (input/label shift)
    shuffle index   a seeded permutation of the samples

All three are built with vectorized numpy (a cumulative sum and one ``searchsorted``), so a billion-token
dataset indexes in seconds, and are cached as ``.npy`` beside the data (see ``index_cache``).
"""
from __future__ import annotations

import hashlib
import math
import os
import time

import numpy as np
import torch

from megafp8.data.index_cache import IndexCache, array_state, dataset_fingerprint, restore_array
from megafp8.data.indexed_dataset import IndexedDataset

_INDEX_VERSION = 1  # bump when the index construction changes, so old caches are not reused


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Epochs whose tokens cover ``num_samples`` samples (each needs ``seq_length`` new tokens, plus 1)."""
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def samples_per_epoch(tokens_per_epoch: int, seq_length: int) -> int:
    return max(0, (tokens_per_epoch - 1) // seq_length)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """One independent permutation of ``documents`` per epoch, concatenated.

    Shuffling within each epoch (rather than across all of them) means every document is seen once
    before any is seen twice, and the first epoch's samples cover each selected document exactly once.
    """
    dtype = np.int32 if (len(documents) == 0 or documents.max() < 2**31) else np.int64
    documents = documents.astype(dtype, copy=False)
    return np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """(num_samples + 1, 2) array of (document-index row, token offset) of tokens 0, L, 2L, ...

    Token ``i * L`` of the concatenated epochs lies in the first row whose cumulative end exceeds it;
    empty documents have no tokens and are stepped over, as in Megatron's C++ ``build_sample_idx``.
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if len(ends) == 0 or positions[-1] >= ends[-1]:
        raise ValueError(f"{num_samples} samples of {seq_length} tokens need more tokens than the document index has")
    rows = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[rows] - lengths[rows])
    dtype = np.int32 if max(len(document_index), int(lengths.max())) < 2**31 else np.int64
    return np.stack([rows, offsets], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, rng: np.random.Generator) -> np.ndarray:
    dtype = np.uint32 if num_samples < 2**32 - 1 else np.int64
    return rng.permutation(num_samples).astype(dtype)


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from a subset of an indexed dataset's documents.

    ``dataset[i]`` is ``{"tokens": LongTensor[seq_length + 1]}``; inputs are ``tokens[:-1]`` and labels
    ``tokens[1:]``. ``num_samples=None`` means one epoch over ``documents``.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        documents: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | None = None,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"--seq-length {seq_length}: must be positive")
        self.dataset = indexed_dataset
        self.seq_length = seq_length
        self.split_name = split_name
        documents = np.asarray(documents, dtype=np.int64)
        tokens_per_epoch = int(np.asarray(indexed_dataset.sequence_lengths)[documents].sum(dtype=np.int64))
        if tokens_per_epoch <= seq_length:
            raise ValueError(
                f"{indexed_dataset.path_prefix}: the {split_name} split has {len(documents)} documents with "
                f"{tokens_per_epoch} tokens, not enough for one sample of --seq-length {seq_length} + 1 tokens "
                "(more data, a shorter sequence or a different --split)"
            )
        if num_samples is None:
            num_samples = samples_per_epoch(tokens_per_epoch, seq_length)
        self.num_samples = int(num_samples)
        self.num_epochs = num_epochs_needed(tokens_per_epoch, self.num_samples, seq_length)

        description = {
            "class": "GPTDataset",
            "index_version": _INDEX_VERSION,
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            "dataset_fingerprint": dataset_fingerprint(indexed_dataset.path_prefix),
            "split": split_name,
            "documents": _describe_documents(documents),
            "num_samples": self.num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        self.cache = IndexCache(cache_dir, f"GPTDataset-{split_name}", description)
        names = ("document_index", "sample_index", "shuffle_index")
        arrays = self.cache.load(names)
        self.cache_hit = arrays is not None
        start = time.perf_counter()
        if arrays is None:
            arrays = dict(zip(names, self._build(documents, seed)))
            self.cache.save(arrays)
            # Map the saved files rather than keep the built copies: workers then pickle paths, not arrays.
            arrays = self.cache.load(names) or arrays
        self.build_seconds = time.perf_counter() - start
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build(self, documents: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        document_index = build_document_index(documents, self.num_epochs, rng)
        sample_index = build_sample_index(
            self.dataset.sequence_lengths, document_index, self.seq_length, self.num_samples
        )
        shuffle_index = build_shuffle_index(self.num_samples, rng)
        return document_index, sample_index, shuffle_index

    _ARRAYS = ("document_index", "sample_index", "shuffle_index")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update({name: array_state(state[name]) for name in self._ARRAYS})
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in self._ARRAYS:
            setattr(self, name, restore_array(state[name]))

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, idx: int) -> np.ndarray:
        """Tokens of sample ``idx`` (after shuffling) as an int64 array of ``seq_length + 1``."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        row = int(self.shuffle_index[idx])
        first_row, first_offset = (int(v) for v in self.sample_index[row])
        last_row, last_offset = (int(v) for v in self.sample_index[row + 1])
        get = self.dataset.get
        if first_row == last_row:
            parts = [get(int(self.document_index[first_row]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(self.document_index[first_row]), first_offset)]
            parts += [get(int(self.document_index[r])) for r in range(first_row + 1, last_row)]
            parts.append(get(int(self.document_index[last_row]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(self.sample(idx))}


def _describe_documents(documents: np.ndarray) -> dict:
    """Short, exact description of the selected documents for the cache key."""
    if len(documents) and np.array_equal(documents, np.arange(documents[0], documents[0] + len(documents))):
        return {"range": [int(documents[0]), int(documents[0]) + len(documents)]}
    return {"count": len(documents), "sha256": hashlib.sha256(documents.tobytes()).hexdigest()}
