"""Train/valid/test splits of a dataset's documents from a Megatron ``--split`` string such as ``969,30,1``."""
from __future__ import annotations

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``) → three weights summing to 1; missing trailing parts are 0."""
    text = split.replace("/", ",")
    try:
        weights = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous [begin, end) document ranges per split, rounded as Megatron so the ends meet exactly."""
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * num_documents)))
    # Rounding can overshoot or undershoot the total by a document or two: shift every bound after the first.
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [max(0, b - excess) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]
