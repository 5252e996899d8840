"""Train/valid/test splits of a dataset's documents from a Megatron ``--split`` string such as ``969,30,1``.

The arithmetic is Megatron-Core's (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``
and the rounding in ``BlendedMegatronDatasetBuilder``), so a split selects the same documents in both.
"""
from __future__ import annotations

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``) → three weights summing to 1; missing trailing parts are 0."""
    # Quotes around the value are what Megatron-LM's Llama script passes (`"--split '99,1,0'"` in a bash array,
    # expanded unquoted); Megatron reads only the numbers, so they are dropped here too.
    text = split.strip().strip("'\"").replace("/", ",")
    try:
        weights = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(weights) <= 3 or not all(0 <= w < float("inf") for w in weights) or not 0 < sum(weights) < float("inf"):
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    # numpy's float64 division, as Megatron's normalize(): the bookends below must round identically.
    vector = np.asarray(weights, dtype=np.float64)
    return (vector / vector.sum()).tolist()


def split_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """[begin, end) document range per split; a split of weight 0 is the empty range (Megatron: no dataset).

    Bookends are the running sums of the weights, and a split's range is ``round(bookend * N)`` at both
    ends, exactly as Megatron-Core computes them, so ranges meet and cover all documents.
    """
    bookends = [0.0]
    for weight in weights:
        bookends.append(bookends[-1] + weight)
    ranges = []
    for begin, end in zip(bookends[:-1], bookends[1:]):
        if end <= begin:
            ranges.append((0, 0))
            continue
        ranges.append((int(round(begin * float(num_documents))), int(round(end * float(num_documents)))))
    return ranges
