"""Build the train/valid/test datasets from ``--data-path``, ``--split`` and the sample counts.

This is the data entry point of the training loop. It knows nothing of torch.distributed: every rank
builds the same datasets (the caches make that cheap after the first) and the loop shards by DP rank
through the sampler.
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Callable, Sequence

import numpy as np
import torch

from megafp8.data.blended_dataset import BlendedDataset, cached_blending_indices, normalize_weights
from megafp8.data.gpt_dataset import GPTDataset, samples_in
from megafp8.data.indexed_dataset import IndexedDataset, bin_path, dataset_exists, idx_path
from megafp8.data.splits import SPLIT_NAMES, parse_split, split_ranges

_MID_LEVEL_SURPLUS = 0.005  # Megatron-Core's BlendedMegatronDatasetConfig.mid_level_dataset_surplus default


def parse_data_path(data_path: Sequence[str] | str) -> tuple[list[float] | None, list[str]]:
    """``["0.3", "A", "0.7", "B"]`` → ([0.3, 0.7], ["A", "B"]); ``["A", "B"]`` → (None, ["A", "B"]).

    Unweighted prefixes are blended in proportion to their sample counts (Megatron). Every prefix must exist.
    """
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    if not items:
        raise ValueError("--data-path: give a dataset prefix, or weight/prefix pairs")
    numeric = [_is_number(x) for x in items]
    if not any(numeric):
        weights, prefixes = None, items
    elif len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights, prefixes = [float(x) for x in items[0::2]], items[1::2]
        normalize_weights(weights)
    else:
        raise ValueError(f"--data-path {' '.join(items)}: expected PREFIX..., or WEIGHT PREFIX pairs")
    for prefix in prefixes:
        if not dataset_exists(prefix):
            missing = idx_path(prefix) if not os.path.isfile(idx_path(prefix)) else bin_path(prefix)
            raise ValueError(f"--data-path {prefix}: {missing} not found (give the prefix without .bin/.idx)")
    return weights, prefixes


def samples_available(data_path: Sequence[str] | str, split: str, seq_length: int,
                      add_extra_token_to_sequence: bool = True) -> list[int | None]:
    """Per split (train, valid, test): the most samples ``build_train_valid_test_datasets`` can give, or
    ``None`` where it builds any count asked for. Cheap: reads the document lengths of each index only.

    Only an unweighted list of several prefixes is bounded: Megatron-Core builds one epoch of each member
    and caps the blend at their sum (``BlendedMegatronDatasetBuilder``, weights ``None`` with a size), so a
    longer request gets a shorter dataset. One prefix repeats its epochs, and a weighted blend sizes its
    members to the request.
    """
    weights, prefixes = parse_data_path(data_path)
    if len(prefixes) == 1 or weights is not None:
        return [None] * len(SPLIT_NAMES)
    split_weights = parse_split(split)
    available = [0] * len(SPLIT_NAMES)
    for prefix in prefixes:
        lengths = np.asarray(IndexedDataset(prefix).sequence_lengths)
        for s, (begin, end) in enumerate(split_ranges(len(lengths), split_weights)):
            tokens = int(lengths[begin:end].sum(dtype=np.int64))
            available[s] += samples_in(tokens, seq_length, int(add_extra_token_to_sequence))
    return available


def default_cache_dir(path_prefix: str) -> str:
    """Where index caches go without ``--data-cache-path``: a ``cache/`` folder beside the data."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")


def build_train_valid_test_datasets(
    data_path: Sequence[str] | str,
    split: str,
    seq_length: int,
    seed: int,
    train_samples: int | None,
    valid_samples: int | None,
    test_samples: int | None,
    cache_dir: str | None = None,
    add_extra_token_to_sequence: bool = True,
    mmap_bin_files: bool = True,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) datasets of ``{"tokens": LongTensor[seq_length + 1]}`` samples.

    The datasets and their sample order are Megatron-Core's ``BlendedMegatronDatasetBuilder``'s for the
    same ``--data-path``, ``--split``, seed, sequence length and sample counts. A count of ``None``
    means one epoch of that split (for a weighted blend, a megafp8 extension: until its first member
    would repeat); ``0``, or a split with no documents, gives ``None`` for that split.

    ``cache_dir`` (``--data-cache-path``) holds every index cache; ``None`` puts each beside its data.
    ``mmap_bin_files=False`` (``--no-mmap-bin-files``) reads the .bin files with file reads: the same samples.
    """
    weights, prefixes = parse_data_path(data_path)
    split_weights = parse_split(split)
    datasets = [IndexedDataset(p, mmap=mmap_bin_files) for p in prefixes]
    ranges = [split_ranges(len(ds), split_weights) for ds in datasets]
    requested = (train_samples, valid_samples, test_samples)
    built = []
    for s, name in enumerate(SPLIT_NAMES):
        documents = [np.arange(*ranges[d][s]) for d in range(len(datasets))]
        if requested[s] == 0 or all(len(docs) == 0 for docs in documents):
            built.append(None)
            continue
        gpt = functools.partial(_gpt, seq_length=seq_length, seed=seed, split_name=name, cache_dir=cache_dir,
                                add_extra_token=add_extra_token_to_sequence)
        if len(datasets) == 1 and weights is None:
            built.append(gpt(datasets[0], documents[0], requested[s]))
            continue
        # A small member can have no documents in a small split (1 of 1000 of 300 documents rounds to 0):
        # the split is then blended from the other members, renormalized, rather than failing the run.
        members = [d for d, docs in enumerate(documents) if len(docs)]
        if len(members) < len(datasets):
            empty = [prefixes[d] for d in range(len(datasets)) if d not in members]
            warnings.warn(f"the {name} split of --split {split} has no documents from {', '.join(empty)}; "
                          "it is blended from the other datasets")
        blend_cache = cache_dir or default_cache_dir(prefixes[0])
        if weights is None:
            built.append(_blend_by_length([gpt(datasets[d], documents[d], None) for d in members],
                                          requested[s], blend_cache))
        else:
            member_weights = normalize_weights([weights[d] for d in members]).tolist()
            size = requested[s]
            if size is None:
                # One epoch of the blend: as many samples as fit before any member repeats.
                epochs = [samples_in(int(np.asarray(datasets[d].sequence_lengths)[documents[d]].sum(dtype=np.int64)),
                                     seq_length, int(add_extra_token_to_sequence)) for d in members]
                size = int(min(count / w for count, w in zip(epochs, member_weights)))
            built.append(_blend_by_weight([datasets[d] for d in members], [documents[d] for d in members],
                                          member_weights, size, gpt, blend_cache))
    return tuple(built)


def mid_level_sizes(weights: Sequence[float], size: int) -> tuple[list[int], list[int]]:
    """Samples the blend takes from each member (its share, rounded up) and the samples each member is
    built with (0.5% more, Megatron's ``mid_level_dataset_surplus``), in Megatron's float arithmetic."""
    targets = [int(math.ceil(size * w)) for w in weights]
    return targets, [int(math.ceil(t * (1 + _MID_LEVEL_SURPLUS))) for t in targets]


def _blend_by_weight(datasets: list[IndexedDataset], documents: list[np.ndarray], weights: list[float],
                     size: int, gpt: Callable[..., GPTDataset], cache: str) -> BlendedDataset:
    """Megatron's weighted blend: members sized by share plus surplus, the blend as long as the shares' sum."""
    targets, buffers = mid_level_sizes(weights, size)
    members = [gpt(ds, docs, buffer) for ds, docs, buffer in zip(datasets, documents, buffers)]
    size = sum(targets)
    dataset_index, dataset_sample_index = cached_blending_indices(weights, size, cache)
    return BlendedDataset(members, weights, size, dataset_index, dataset_sample_index)


def _blend_by_length(members: list[GPTDataset], size: int | None, cache: str) -> BlendedDataset:
    """Megatron's unweighted blend: one epoch per member, weighted by member length (samples); without a
    sample count every sample of every member exactly once, else ``size`` samples (at most all of them)."""
    lengths = [len(m) for m in members]
    if size is None:
        dataset_index, dataset_sample_index = cached_blending_indices(None, None, cache, sizes=lengths)
        return BlendedDataset(members, lengths, sum(lengths), dataset_index, dataset_sample_index)
    size = min(size, sum(lengths))
    dataset_index, dataset_sample_index = cached_blending_indices(lengths, size, cache)
    return BlendedDataset(members, lengths, size, dataset_index, dataset_sample_index)


def _gpt(ds: IndexedDataset, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int,
         split_name: str, cache_dir: str | None, add_extra_token: bool) -> GPTDataset:
    return GPTDataset(ds, documents, num_samples, seq_length, seed, split_name,
                      cache_dir or default_cache_dir(ds.path_prefix), add_extra_token)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
