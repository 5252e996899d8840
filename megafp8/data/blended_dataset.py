"""Blend several datasets by weight (``--data-path 0.3 A 0.7 B``) into one deterministic sample order.

Sample ``k`` of dataset ``d`` is given the ideal time ``(k + 0.5) / w_d``; merging all datasets' samples by
that time (a stable sort, ties to the lower dataset) interleaves them so that after any ``n`` samples
dataset ``d`` has contributed ``w_d * n`` samples to within about one. This is the same guarantee as
Megatron-LM's greedy ``build_blending_indices``, computed with one vectorized sort instead of a loop.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from megafp8.data.index_cache import IndexCache, array_state, restore_array


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or np.any(~np.isfinite(weights)) or np.any(weights <= 0):
        raise ValueError(f"--data-path weights must be positive numbers, got {list(weights)}")
    return weights / weights.sum()


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset it comes from, and which sample of that dataset it is."""
    weights = normalize_weights(weights)
    times, dataset_ids, sample_ids = [], [], []
    for d, weight in enumerate(weights):
        # Enough candidates that the n-th smallest time overall is always covered for this dataset.
        count = min(num_samples, math.ceil(weight * num_samples) + 2)
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / weight)
        dataset_ids.append(np.full(count, d, dtype=np.int16))
        sample_ids.append(k)
    order = np.argsort(np.concatenate(times), kind="stable")[:num_samples]
    return np.concatenate(dataset_ids)[order], np.concatenate(sample_ids)[order]


def samples_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> list[int]:
    return np.bincount(dataset_index, minlength=num_datasets).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights``.

    Each member dataset must hold at least as many samples as the blend takes from it (see
    ``samples_per_dataset``); the builder sizes them exactly that way.
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
    weights: Sequence[float], num_samples: int, cache_dir: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """``build_blending_indices`` through the index cache (an argsort over 10^8 samples takes a while).

    The indices depend on the weights and the sample count alone, so that is the whole cache key.
    """
    description = {
        "class": "BlendedDataset",
        "weights": [float(w) for w in normalize_weights(weights)],
        "num_samples": int(num_samples),
    }
    cache = IndexCache(cache_dir, "BlendedDataset", description)
    arrays = cache.load(("dataset_index", "dataset_sample_index"))
    if arrays is None:
        dataset_index, dataset_sample_index = build_blending_indices(weights, num_samples)
        arrays = {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}
        cache.save(arrays)
        arrays = cache.load(("dataset_index", "dataset_sample_index")) or arrays
    return arrays["dataset_index"], arrays["dataset_sample_index"]
