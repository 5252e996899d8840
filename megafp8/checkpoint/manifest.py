"""The manifest that marks a checkpoint complete: iteration, layout, flags, contents, and the size and
SHA-256 of every file, so a truncated or corrupted file is reported by name before anything is read."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megafp8.checkpoint.atomic import MANIFEST_FILE, fsync_path
from megafp8.checkpoint.errors import CheckpointError

FORMAT = "megafp8-dcp"
FORMAT_VERSION = 1


def digest_file(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of ``path``, which is also fsynced (it was just written by DCP)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def check_file(directory: Path, name: str, expected: dict[str, Any], hash_contents: bool) -> str | None:
    """None if ``name`` matches its manifest entry, else what is wrong with it."""
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    if size != expected["bytes"]:
        return f"{path} is truncated or overwritten: {size} bytes, the manifest says {expected['bytes']}"
    if hash_contents and digest_file(path)["sha256"] != expected["sha256"]:
        return f"{path} is corrupt: its SHA-256 differs from the manifest's"
    return None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    path = directory / MANIFEST_FILE
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint directory, or a CheckpointError naming what is wrong."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist; check --load and "
                              f"{directory.parent / 'latest_checkpointed_iteration.txt'}")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete megafp8 checkpoint: {MANIFEST_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a megafp8 checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{directory} was written by a newer megafp8 (format version "
                              f"{manifest['format_version']} > {FORMAT_VERSION}); upgrade megafp8 to load it")
    return manifest
