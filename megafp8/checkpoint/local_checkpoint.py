"""Non-persistent local checkpoints (--non-persistent-ckpt-type local): each rank writes its own state, as it holds
it, to node-local storage; no collective, no resharding: a run resumes from one only at the same layout.

    <--non-persistent-local-ckpt-dir>/iter_NNNNNNN/rank_RRRRR.pt     torch.save of the rank's tensors and counters
    <--non-persistent-local-ckpt-dir>/iter_NNNNNNN/rank_RRRRR.json   written last: size and sha256 of the .pt, the
                                                                     layout and the rank (the file's commit mark)

Each file is written under a temporary name, fsynced and renamed; the .json makes it complete. A rank keeps only
its newest complete iteration (older ones are removed once the new one is complete). Loading reads the .pt with
``torch.load(weights_only=True)``: tensors and plain containers only, no code from the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megafp8.checkpoint.atomic import fsync_path, iteration_dir
from megafp8.checkpoint.manifest import check_file, digest_file

FORMAT = "megafp8-local-checkpoint-1"


def _files(root: str | os.PathLike, iteration: int, rank: int) -> tuple[Path, Path]:
    directory = iteration_dir(root, iteration)
    return directory / f"rank_{rank:05d}.pt", directory / f"rank_{rank:05d}.json"


def _write(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def save_local(root: str | os.PathLike, iteration: int, rank: int, state: dict[str, Any], layout: dict) -> Path:
    """Write this rank's ``state`` (tensors, numbers, strings, containers) for ``iteration``; returns the .pt."""
    data, mark = _files(root, iteration, rank)
    data.parent.mkdir(parents=True, exist_ok=True)
    _write(data, lambda f: torch.save(state, f))
    facts = {"format": FORMAT, "iteration": iteration, "rank": rank, "layout": layout, **digest_file(data)}
    _write(mark, lambda f: f.write(json.dumps(facts).encode()))
    fsync_path(data.parent)
    for older in complete_iterations(root, rank):
        if older < iteration:
            for path in _files(root, older, rank):
                path.unlink(missing_ok=True)
            _remove_if_empty(iteration_dir(root, older))
    return data


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # another rank's files are still there (or it is gone already)
        pass


def complete_iterations(root: str | os.PathLike, rank: int) -> list[int]:
    """The iterations for which this rank's commit mark exists (its file is checked when loaded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for directory in root.glob("iter_*"):
        suffix = directory.name[len("iter_"):]
        if suffix.isdigit() and (directory / f"rank_{rank:05d}.json").is_file():
            found.append(int(suffix))
    return sorted(found)


def check_local(root: str | os.PathLike, iteration: int, rank: int, layout: dict) -> str | None:
    """Why this rank cannot resume from its file of ``iteration`` (None: it can): missing, truncated or changed
    since written (size, sha256), or saved at another layout."""
    data, mark = _files(root, iteration, rank)
    if not mark.is_file():
        return f"rank {rank} has no complete file for iteration {iteration} in {Path(root)}"
    try:
        facts = json.loads(mark.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{mark}: unreadable ({e})"
    if facts.get("format") != FORMAT:
        return f"{mark}: not a megafp8 local checkpoint"
    if facts.get("layout") != layout:
        return f"{mark}: saved at layout {facts.get('layout')}, this run is {layout} (local checkpoints do not reshard)"
    return check_file(data.parent, data.name, facts, hash_contents=True)


def load_local(root: str | os.PathLike, iteration: int, rank: int) -> dict[str, Any]:
    data, _ = _files(root, iteration, rank)
    return torch.load(data, map_location="cpu", weights_only=True)
