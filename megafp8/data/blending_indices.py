"""Megatron-Core's blending indices: which dataset, and which of its samples, each blended sample is.

Megatron interleaves datasets greedily: sample n goes to the dataset whose error
``weight * max(n, 1) - samples_taken_so_far`` is largest (ties to the lower index), in float64. The
choice at each step depends on every earlier one and floating-point ties decide often (0.3 * 10 rounds
to exactly 3), so no sort or closed form reproduces it: it is a sequential loop. That loop runs as a
tiny C function compiled on first use with the system C compiler (cached by source hash, loaded with
ctypes; as fast as Megatron's C++), and as plain Python where no compiler exists (a few hundred
thousand samples per second, with a warning). Both are tested against Megatron-Core's own C++.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from typing import Sequence

import numpy as np

_SOURCE = r"""
#include <stdint.h>
#include <float.h>

/* Megatron-Core's build_blending_indices: the largest error weight * max(n, 1) - taken wins. */
void greedy_blend(const double *restrict weights, int32_t num_datasets, int64_t size,
                  int16_t *restrict dataset_index, int64_t *restrict dataset_sample_index,
                  int64_t *restrict taken) {
  for (int64_t n = 0; n < size; ++n) {
    double steps = n > 1 ? (double)n : 1.0;
    int32_t best = 0;
    double best_error = weights[0] * steps - (double)taken[0];
    for (int32_t d = 1; d < num_datasets; ++d) {
      double error = weights[d] * steps - (double)taken[d];
      if (error > best_error) { best_error = error; best = d; }
    }
    dataset_index[n] = (int16_t)best;
    dataset_sample_index[n] = taken[best]++;
  }
}

/* Megatron-Core's build_exhaustive_blending_indices: the same greedy rule over the datasets not yet
   exhausted, with weights sizes / total, until every dataset has given exactly sizes[d] samples. */
void exhaustive_blend(const int64_t *restrict sizes, const double *restrict weights, int32_t num_datasets,
                      int64_t total, int16_t *restrict dataset_index, int64_t *restrict dataset_sample_index,
                      int64_t *restrict taken) {
  for (int64_t n = 0; n < total; ++n) {
    double steps = n > 1 ? (double)n : 1.0;
    int32_t best = -1;
    double best_error = -DBL_MAX;
    for (int32_t d = 0; d < num_datasets; ++d) {
      if (taken[d] == sizes[d]) continue;
      double error = weights[d] * steps - (double)taken[d];
      if (error > best_error) { best_error = error; best = d; }
    }
    dataset_index[n] = (int16_t)best;
    dataset_sample_index[n] = taken[best]++;
  }
}
"""

_library: ctypes.CDLL | None = None
_compile_failed = False


def _cache_root() -> str:
    return os.environ.get("MEGAFP8_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megafp8")


def _load_library() -> ctypes.CDLL | None:
    """The compiled helper, built once per source version; None (and a warning) if it cannot be built."""
    global _library, _compile_failed
    if _library is not None or _compile_failed:
        return _library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    path = os.path.join(_cache_root(), f"blending_indices-{digest}.so")
    try:
        if not os.path.isfile(path):
            if compiler is None:
                raise OSError("no C compiler (cc or gcc) on PATH")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
                source = os.path.join(tmp, "blending_indices.c")
                with open(source, "w") as f:
                    f.write(_SOURCE)
                # No FMA contraction: each product must round on its own, as in Megatron's build.
                subprocess.run([compiler, "-O2", "-ffp-contract=off", "-shared", "-fPIC", source,
                                "-o", os.path.join(tmp, "lib.so")], check=True, capture_output=True)
                os.replace(os.path.join(tmp, "lib.so"), path)  # atomic: concurrent ranks race safely
        library = ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as exc:
        _compile_failed = True
        warnings.warn(f"could not build the compiled blending helper ({exc}); blending indices are built in "
                      "pure Python (a few hundred thousand samples per second; they are cached afterwards)")
        return None
    pointer = np.ctypeslib.ndpointer
    library.greedy_blend.argtypes = [pointer(np.float64, flags="C"), ctypes.c_int32, ctypes.c_int64,
                                     pointer(np.int16, flags="C"), pointer(np.int64, flags="C"),
                                     pointer(np.int64, flags="C")]
    library.exhaustive_blend.argtypes = [pointer(np.int64, flags="C"), pointer(np.float64, flags="C"),
                                         ctypes.c_int32, ctypes.c_int64, pointer(np.int16, flags="C"),
                                         pointer(np.int64, flags="C"), pointer(np.int64, flags="C")]
    library.greedy_blend.restype = library.exhaustive_blend.restype = None
    _library = library
    return library


def greedy_blending_indices(
    weights: Sequence[float], size: int, compiled: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of ``size`` samples blended by ``weights``.

    ``weights`` are used as given (normalize them first, as Megatron's BlendedDataset does).
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    taken = np.zeros(len(weights), dtype=np.int64)
    library = _load_library() if compiled else None
    if library is not None:
        library.greedy_blend(weights, len(weights), size, dataset_index, dataset_sample_index, taken)
    else:
        _python_loop(weights.tolist(), [None] * len(weights), size, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices(sizes: Sequence[int], compiled: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Blending indices that take exactly ``sizes[d]`` samples of every dataset d, interleaved by size."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    weights = sizes / np.float64(total)
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    taken = np.zeros(len(sizes), dtype=np.int64)
    library = _load_library() if compiled else None
    if library is not None:
        library.exhaustive_blend(sizes, weights, len(sizes), total, dataset_index, dataset_sample_index, taken)
    else:
        _python_loop(weights.tolist(), sizes.tolist(), total, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def _python_loop(weights: list[float], limits: list, size: int, dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray) -> None:
    """The same loop as the C source; a dataset with ``limits[d]`` samples taken no longer competes."""
    taken = [0] * len(weights)
    datasets = range(len(weights))
    chosen, positions = [0] * size, [0] * size
    for n in range(size):
        steps = float(max(n, 1))
        best, best_error = -1, -float("inf")
        for d in datasets:
            if taken[d] == limits[d]:
                continue
            error = weights[d] * steps - taken[d]
            if error > best_error:
                best, best_error = d, error
        chosen[n], positions[n] = best, taken[best]
        taken[best] += 1
    dataset_index[:] = chosen
    dataset_sample_index[:] = positions
