"""On-disk names and the atomic commit: a checkpoint is invisible until it is complete.

    <save>/iter_0000010.tmp-<uuid>/   written and fsynced here first (never loaded, removed by the next save)
    <save>/iter_0000010/              appears by one rename once every file and the manifest are durable
    <save>/latest_checkpointed_iteration.txt   rewritten last, by temp file + fsync + rename

A crash at any point leaves either the previous ``latest`` (pointing at a complete directory) or the
new one; the tracker file is the only source of truth for which checkpoint to resume.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from megafp8.checkpoint.errors import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "megafp8_checkpoint.json"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_TEMP_DIR = re.compile(r"^iter_\d{7,}\.(tmp|old)-[0-9a-f]+$")


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def temporary_dir(root: str | os.PathLike, iteration: int, token: str | None = None) -> Path:
    return Path(root) / f"iter_{iteration:07d}.tmp-{token or uuid.uuid4().hex}"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` by ``text`` so that readers see the old or the new content, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_tracker(root: str | os.PathLike) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None when there is no tracker file."""
    tracker = Path(root) / TRACKER_FILE
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read {tracker}: {e}") from None
    if not text.isdigit():
        raise CheckpointError(f"{tracker} is corrupt: expected an iteration number, found {text[:40]!r}; "
                              f"write the iteration of a complete iter_XXXXXXX directory into it")
    return int(text)


def committed_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations that have a committed directory (temporaries excluded), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def remove_stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete leftovers of interrupted saves (``iter_*.tmp-*`` / ``iter_*.old-*``). Only one job writes a
    save directory at a time, so any temporary found before a save starts belongs to a dead writer."""
    removed = []
    for entry in Path(root).iterdir():
        if _TEMP_DIR.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def commit_directory(tmp: Path, final: Path) -> None:
    """Make the fully written and fsynced ``tmp`` visible as ``final`` (one rename, then a parent fsync).

    An existing ``final`` (the same iteration saved again) is first moved aside and deleted after."""
    fsync_path(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def save_dir_error(root: str | os.PathLike, flag: str = "--save") -> str | None:
    """Why ``flag root`` could not take a checkpoint (not a directory, under a file, not writable), checked before
    the work: the first save is iterations (or a whole conversion) away, and failing there loses it. None when
    it can."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        return f"{flag} {root}: exists and is not a directory"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {root}: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {root}: {existing} is not writable"
    return None


def prune_checkpoints(root: str | os.PathLike, keep_last: int, protect: int) -> list[Path]:
    """Delete committed checkpoints older than the ``keep_last`` newest (counting only directories holding
    megafp8's manifest; nothing else is touched); never ``protect`` (the one the tracker names). Called only after
    the new checkpoint and the tracker are committed."""
    if keep_last < 1:
        raise CheckpointError(f"--keep-last must be >= 1, got {keep_last}")
    # Only directories megafp8 wrote (their manifest is there): an iter_* folder of anything else is the user's.
    iterations = [it for it in committed_iterations(root) if (iteration_dir(root, it) / MANIFEST_FILE).is_file()]
    doomed = [it for it in iterations[:-keep_last] if it != protect] if len(iterations) > keep_last else []
    removed = []
    for it in doomed:
        path = iteration_dir(root, it)
        # Rename first so a crash mid-delete leaves a temporary (cleaned later), not a torn iter_ dir.
        trash = path.with_name(f"{path.name}.old-{uuid.uuid4().hex}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_path(root)
    return removed
