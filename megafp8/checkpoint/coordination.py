"""Collective agreement for checkpoint steps: every rank runs a step, then all learn whether any failed,
so one rank's error becomes the same clear error everywhere instead of peers waiting forever.

Every function takes the process group to agree over: None is the default (whole-world) group; an asynchronous save
passes the whole-world gloo group (``CHECKPOINT_GLOO``), so its background thread never shares a communicator with
the training's collectives."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from megafp8.checkpoint.errors import CheckpointError

T = TypeVar("T")


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    rank, size = world(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    if world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def run_agreed(step: Callable[[], T], what: str, group: dist.ProcessGroup | None = None) -> T:
    """Run ``step`` on this rank, then raise a CheckpointError on every rank if it failed on any.

    A CheckpointError keeps its message; any other exception is summarized in one line."""
    result, error, error_type = None, None, CheckpointError
    try:
        result = step()
    except CheckpointError as e:
        error, error_type = str(e), type(e)  # keep subclasses (ArgsMismatchError) for callers that catch them
    except Exception as e:  # noqa: BLE001 - reported collectively below, with its type and message
        error = f"{what}: {type(e).__name__}: {e}"
    errors = all_gather_object(error, group)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        unique = list(dict.fromkeys(message for _, message in failed))
        if len(unique) > 3:  # rank-specific variants of one problem: show a few
            unique = unique[:3] + [f"... and {len(unique) - 3} more different messages"]
        ranks = [rank for rank, _ in failed]
        prefix = f"(rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}) " if world(group)[1] > 1 else ""
        raise error_type(prefix + "\n".join(unique))
    return result  # type: ignore[return-value]
