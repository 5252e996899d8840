"""Build the train/valid/test datasets from ``--data-path``, ``--split`` and the sample counts.

This is the data entry point of the training loop. It knows nothing of torch.distributed: every rank
builds the same datasets (the caches make that cheap after the first) and the loop shards by DP rank
through the sampler.
"""
from __future__ import annotations

import os
import warnings
from typing import Sequence

import numpy as np
import torch

from megafp8.data.blended_dataset import BlendedDataset, cached_blending_indices, normalize_weights
from megafp8.data.gpt_dataset import GPTDataset, samples_per_epoch
from megafp8.data.indexed_dataset import IndexedDataset, bin_path, dataset_exists, idx_path
from megafp8.data.splits import SPLIT_NAMES, parse_split, split_ranges


def parse_data_path(data_path: Sequence[str] | str) -> tuple[list[float] | None, list[str]]:
    """``["0.3", "A", "0.7", "B"]`` → ([0.3, 0.7], ["A", "B"]); ``["A", "B"]`` → (None, ["A", "B"]).

    Unweighted prefixes are blended in proportion to their token counts. Every prefix must exist.
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


def default_cache_dir(path_prefix: str) -> str:
    """Where index caches go unless told otherwise: a ``cache/`` folder beside the data."""
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
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """(train, valid, test) datasets of ``{"tokens": LongTensor[seq_length + 1]}`` samples.

    A sample count of ``None`` means one epoch of that split (for a blend: until its first member would
    repeat); ``0``, or a split with no documents, gives ``None`` for that split.
    """
    weights, prefixes = parse_data_path(data_path)
    split_weights = parse_split(split)
    datasets = [IndexedDataset(p) for p in prefixes]
    ranges = [split_ranges(len(ds), split_weights) for ds in datasets]
    requested = (train_samples, valid_samples, test_samples)
    built = []
    for s, name in enumerate(SPLIT_NAMES):
        documents = [np.arange(*ranges[d][s]) for d in range(len(datasets))]
        if requested[s] == 0 or all(len(docs) == 0 for docs in documents):
            built.append(None)
            continue
        if len(datasets) == 1:
            built.append(_gpt(datasets[0], documents[0], requested[s], seq_length, seed, name, cache_dir))
            continue
        # A small member can have no documents in a small split (1 of 1000 of 300 documents rounds to 0):
        # the split is then blended from the other members, renormalized, rather than failing the run.
        members = [d for d, docs in enumerate(documents) if len(docs)]
        if len(members) < len(datasets):
            empty = [prefixes[d] for d in range(len(datasets)) if d not in members]
            warnings.warn(f"the {name} split of --split {split} has no documents from {', '.join(empty)}; "
                          "it is blended from the other datasets")
        split_tokens = [int(np.asarray(datasets[d].sequence_lengths)[documents[d]].sum(dtype=np.int64))
                        for d in members]
        blend_weights = normalize_weights([weights[d] for d in members] if weights is not None else split_tokens)
        num_samples = requested[s]
        if num_samples is None:
            # One epoch of the blend: as many samples as possible before any member repeats.
            num_samples = int(min(samples_per_epoch(t, seq_length) / w for t, w in zip(split_tokens, blend_weights)))
        blend_cache = cache_dir or default_cache_dir(prefixes[0])
        dataset_index, dataset_sample_index = cached_blending_indices(blend_weights, num_samples, blend_cache)
        counts = np.bincount(dataset_index, minlength=len(members))
        member_datasets = [
            _gpt(datasets[d], documents[d], max(int(count), 1), seq_length, seed, name, cache_dir)
            for d, count in zip(members, counts)
        ]
        built.append(BlendedDataset(member_datasets, blend_weights, num_samples, dataset_index, dataset_sample_index))
    return tuple(built)


def _gpt(ds: IndexedDataset, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int,
         split_name: str, cache_dir: str | None) -> GPTDataset:
    return GPTDataset(ds, documents, num_samples, seq_length, seed, split_name,
                      cache_dir or default_cache_dir(ds.path_prefix))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
