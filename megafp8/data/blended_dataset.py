"""Blend several datasets by weight (``--data-path 0.3 A 0.7 B``) into one deterministic sample order.

The order is Megatron-Core's ``BlendedDataset``: a greedy interleave that gives each next sample to the
dataset furthest below its share (see ``blending_indices``), or, for an unweighted list without a sample
count, an exhaustive interleave that takes every sample of every member exactly once.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megafp8.data.blending_indices import exhaustive_blending_indices, greedy_blending_indices
from megafp8.data.index_cache import IndexCache, array_state, restore_array

_INDEX_VERSION = 2  # bump when the blending changes, so old caches are not reused


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights divided by their sum in float64, as Megatron's ``normalize`` (the blend depends on the bits)."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or np.any(~np.isfinite(weights)) or np.any(weights <= 0) or not np.isfinite(weights.sum()):
        raise ValueError(f"--data-path weights must be positive numbers with a finite sum, got {list(weights)}")
    return weights / weights.sum()


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset it comes from, and which sample of that dataset it is."""
    return greedy_blending_indices(normalize_weights(weights), num_samples)


def samples_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> list[int]:
    return np.bincount(dataset_index, minlength=num_datasets).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights``.

    Each member dataset must hold at least as many samples as the blend takes from it (see
    ``samples_per_dataset``); the builder sizes them as Megatron does (its share plus 0.5%).
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        num_samples: int,
        dataset_index: np.ndarray | None = None,
        dataset_sample_index: np.ndarray | None = None,
    ) -> None:
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = int(num_samples)
        if dataset_index is None or dataset_sample_index is None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.num_samples)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        for d, needed in enumerate(samples_per_dataset(dataset_index, len(self.datasets))):
            if needed > len(self.datasets[d]):
                raise ValueError(
                    f"the blend takes {needed} samples from dataset {d}, which has only {len(self.datasets[d])}"
                )

    def __getstate__(self) -> dict:  # pass cached index files by path to data-loader workers
        state = dict(self.__dict__)
        state.update(dataset_index=array_state(self.dataset_index),
                     dataset_sample_index=array_state(self.dataset_sample_index))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.dataset_index = restore_array(state["dataset_index"])
        self.dataset_sample_index = restore_array(state["dataset_sample_index"])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]


def cached_blending_indices(
    weights: Sequence[float] | None, num_samples: int | None, cache_dir: str | None,
    sizes: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Blending indices through the index cache: greedy by normalized ``weights`` for ``num_samples``, or,
    with ``sizes`` (and no weights), the exhaustive interleave of exactly ``sizes[d]`` samples each.

    The indices depend on these inputs alone, so they are the whole cache key.
    """
    if sizes is not None:
        description = {"class": "BlendedDataset", "index_version": _INDEX_VERSION, "exhaustive_sizes": [int(s) for s in sizes]}
    else:
        description = {"class": "BlendedDataset", "index_version": _INDEX_VERSION,
                       # repr keeps every bit: the greedy blend changes with the last bit of a weight
                       "weights": [repr(float(w)) for w in normalize_weights(weights)], "num_samples": int(num_samples)}
    cache = IndexCache(cache_dir, "BlendedDataset", description)
    arrays = cache.load(("dataset_index", "dataset_sample_index"))
    if arrays is None:
        if sizes is not None:
            dataset_index, dataset_sample_index = exhaustive_blending_indices(sizes)
        else:
            dataset_index, dataset_sample_index = build_blending_indices(weights, num_samples)
        arrays = {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}
        cache.save(arrays)
        arrays = cache.load(("dataset_index", "dataset_sample_index")) or arrays
    return arrays["dataset_index"], arrays["dataset_sample_index"]
