"""GPT pretraining samples: ``seq_length + 1`` consecutive tokens cut across document boundaries.

The sample order is Megatron-Core 0.16.1's ``GPTDataset``, index for index, so a Megatron run's
consumed-samples position means the same data here. Three index arrays define the samples:

    document index  the split's documents tiled over every epoch the requested samples need, all epochs
                    shuffled together with ``numpy.random.RandomState(seed)``; a final epoch of which
                    less than 80% is used is shuffled separately (``separate_final_epoch``), so the
                    used part of it is still a random subset
    sample index    (samples + 1, 2): for sample i, the position (row in the document index, token
                    offset) where it starts; samples are built for the whole epochs, not only the
                    requested count
    shuffle index   a permutation of all those samples (the final epoch's, when separate, apart)

The sample index is vectorized numpy (a cumulative sum and one ``searchsorted``) equal to Megatron's C++
``build_sample_idx``. The arrays are cached as ``.npy`` in the cache directory (``--data-cache-path``, by
default beside the data; see ``index_cache``).
"""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import torch

from megafp8.data.index_cache import IndexCache, array_state, dataset_fingerprint, restore_array
from megafp8.data.indexed_dataset import IndexedDataset

_INDEX_VERSION = 2  # bump when the index construction changes, so old caches are not reused
# Megatron-Core's threshold: a final epoch of which fewer than this share of samples is used is
# shuffled on its own instead of together with the full epochs.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int = 1) -> int:
    """Epochs whose tokens cover ``num_samples`` samples of ``seq_length`` new tokens plus ``extra``."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + extra
    return max(1, -(-requested // tokens_per_epoch))


def samples_in(tokens: int, seq_length: int, extra: int = 1) -> int:
    """Samples that ``tokens`` consecutive tokens hold (the last partial sequence dropped)."""
    return max(0, (tokens - extra) // seq_length)


def uses_separate_final_epoch(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int = 1
) -> bool:
    """Megatron's rule: shuffle the last epoch apart when less than 80% of its samples are requested."""
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    if num_epochs == 1:
        return False
    from_final_epoch = num_samples - samples_in((num_epochs - 1) * tokens_per_epoch, seq_length, extra)
    return from_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_in(tokens_per_epoch, seq_length, extra))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool = False
) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times and shuffled in place (int32, as Megatron asserts).

    All epochs are shuffled together, so epochs mix; with ``separate_final_epoch`` the first
    ``num_epochs - 1`` are shuffled together and the last one after them, on its own.
    """
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng)
        return np.concatenate([first, build_document_index(documents, 1, rng)])
    document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_samples: int | None = None,
    add_extra_token: bool = True,
) -> np.ndarray:
    """(num_samples + 1, 2) array of (document-index row, token offset) bounding each sample.

    ``num_samples=None`` means every sample the document index holds. Entry i + 1 is where sample i
    ends: with the extra token, the row holding token ``(i + 1) * L`` (its last token, which the next
    sample starts from); without, the row holding token ``(i + 1) * L - 1`` and the offset just past it.
    Empty documents have no tokens and are stepped over. Equal to Megatron's C++ ``build_sample_idx``
    (with ``drop_last_partial_sequence``), including entry 0 = (0, 0).
    """
    extra = int(add_extra_token)
    lengths = np.asarray(sequence_lengths)[document_index]
    ends = np.cumsum(lengths, dtype=np.int64)
    available = samples_in(int(ends[-1]) if len(ends) else 0, seq_length, extra)
    if num_samples is None:
        num_samples = available
    if num_samples > available:
        raise ValueError(f"{num_samples} samples of {seq_length} tokens need more tokens than the document index has")
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    # The row holding token p (with the extra token) or token p - 1 (without): the first row ending after it.
    rows = np.searchsorted(ends, positions - (1 - extra), side="right")
    offsets = positions - ends[rows] + lengths[rows]
    largest = max(len(document_index), int(lengths.max()) if len(lengths) else 0)
    sample_index = np.zeros((num_samples + 1, 2), dtype=np.int32 if largest <= np.iinfo(np.int32).max else np.int64)
    sample_index[1:, 0] = rows
    sample_index[1:, 1] = offsets
    return sample_index


def build_shuffle_index(
    num_samples: int, rng: np.random.RandomState, total_size: int | None = None
) -> np.ndarray:
    """A shuffled ``arange(num_samples)``, followed by a separately shuffled ``arange(num_samples, total_size)``."""
    total_size = num_samples if total_size is None else total_size
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if total_size == num_samples:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    add_extra_token: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle index, drawn from one ``RandomState(seed)`` in Megatron's order."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    separate_final_epoch = uses_separate_final_epoch(tokens_per_epoch, num_samples, seq_length, extra)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, None, add_extra_token)
    total = len(sample_index) - 1
    first_range = samples_in((num_epochs - 1) * tokens_per_epoch, seq_length, extra) if separate_final_epoch else total
    return document_index, sample_index, build_shuffle_index(first_range, rng, total)


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens (``seq_length`` without the extra token) from some documents.

    ``dataset[i]`` is ``{"tokens": LongTensor[seq_length + 1]}``; inputs are ``tokens[:-1]`` and labels
    ``tokens[1:]``. ``num_samples`` is the count requested (``None``: one epoch); as in Megatron, whole
    epochs are built, so ``len(dataset)`` is at least that.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,  # or a MockLowLevelDataset (--mock-data)
        documents: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | None = None,
        add_extra_token_to_sequence: bool = True,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"--seq-length {seq_length}: must be positive")
        self.dataset = indexed_dataset
        self.seq_length = seq_length
        self.split_name = split_name
        self.extra = int(add_extra_token_to_sequence)
        documents = np.asarray(documents, dtype=np.int64)
        tokens_per_epoch = int(np.asarray(indexed_dataset.sequence_lengths)[documents].sum(dtype=np.int64))
        if samples_in(tokens_per_epoch, seq_length, self.extra) == 0:
            raise ValueError(
                f"{indexed_dataset.path_prefix}: the {split_name} split has {len(documents)} documents with "
                f"{tokens_per_epoch} tokens, not enough for one sample of --seq-length {seq_length} + "
                f"{self.extra} tokens (more data, a shorter sequence or a different --split)"
            )
        self.num_samples = samples_in(tokens_per_epoch, seq_length, self.extra) if num_samples is None else int(num_samples)
        self.num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, self.extra)

        description = {
            "class": "GPTDataset",
            "index_version": _INDEX_VERSION,
            **_describe_source(indexed_dataset),
            "split": split_name,
            "documents": _describe_documents(documents),
            "num_samples": num_samples,  # None (one epoch) and its count give the same arrays, but keep them apart
            "seq_length": seq_length,
            "seed": seed,
            "add_extra_token_to_sequence": bool(self.extra),
        }
        self.cache = IndexCache(cache_dir, f"GPTDataset-{split_name}", description)
        names = ("document_index", "sample_index", "shuffle_index")
        arrays = self.cache.load(names)
        self.cache_hit = arrays is not None
        start = time.perf_counter()
        if arrays is None:
            built = build_indices(indexed_dataset.sequence_lengths, documents, num_samples, seq_length, seed,
                                  bool(self.extra))
            arrays = dict(zip(names, built))
            self.cache.save(arrays)
            # Map the saved files rather than keep the built copies: workers then pickle paths, not arrays.
            arrays = self.cache.load(names) or arrays
        self.build_seconds = time.perf_counter() - start
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

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
        return len(self.sample_index) - 1

    def sample(self, idx: int) -> np.ndarray:
        """Tokens of sample ``idx`` (after shuffling) as an int64 array of ``seq_length + 1`` (or ``seq_length``)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        row = int(self.shuffle_index[idx])
        first_row, first_offset = (int(v) for v in self.sample_index[row])
        last_row, last_offset = (int(v) for v in self.sample_index[row + 1])
        get = self.dataset.get
        if first_row == last_row:
            parts = [get(int(self.document_index[first_row]), first_offset, last_offset - first_offset + self.extra)]
        else:
            parts = [get(int(self.document_index[first_row]), first_offset)]
            parts += [get(int(self.document_index[r])) for r in range(first_row + 1, last_row)]
            parts.append(get(int(self.document_index[last_row]), 0, last_offset + self.extra))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(self.sample(idx))}


def _describe_source(dataset) -> dict:
    """The low-level dataset's part of the cache key: a .bin/.idx pair's path and content fingerprint, or what a
    synthetic one (``mock_dataset``) says its sequence lengths follow from."""
    if isinstance(dataset, IndexedDataset):
        return {"path_prefix": os.path.abspath(dataset.path_prefix),
                "dataset_fingerprint": dataset_fingerprint(dataset.path_prefix)}
    return dataset.cache_identity()


def _describe_documents(documents: np.ndarray) -> dict:
    """Short, exact description of the selected documents for the cache key."""
    if len(documents) and np.array_equal(documents, np.arange(documents[0], documents[0] + len(documents))):
        return {"range": [int(documents[0]), int(documents[0]) + len(documents)]}
    return {"count": len(documents), "sha256": hashlib.sha256(documents.tobytes()).hexdigest()}
