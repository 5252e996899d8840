"""Asynchronous checkpoint saves (--async-save): the saving step only copies the state to host memory; a background
thread writes, checksums and commits it while training goes on.

The copy is the synchronous save's own state dict (``checkpoint_state``: model, optimizer, FP8 scaling state, RNG,
guard, progress), every tensor copied to (pinned, on CUDA) host memory, so the files are the ones a synchronous save
of that step writes. The thread runs ``write_checkpoint`` with every collective over a whole-world gloo group of its
own: it never shares a communicator with the training's collectives, and the commit (the rename and
``latest_checkpointed_iteration.txt``) happens only after every rank's files are written, as in a synchronous save.
A new save first waits for the previous one; ``--keep-last`` prunes at the commit, so only committed checkpoints
are deleted; the training loop waits for the last one before the process exits (end, --exit-interval, SIGTERM).
A crash while the thread writes leaves the previous checkpoint as ``latest``: the new one is still a temporary
directory, which the next save removes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megafp8.checkpoint.save_load import write_checkpoint
from megafp8.checkpoint.sharded_tensor import ShardedChunks


def stage_to_host(state: Any) -> Any:
    """A copy of ``state`` whose tensors live in host memory (pinned on CUDA machines; one synchronization at the
    end), other leaves as they are (bytes and numbers do not change under the training)."""
    copies = []

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            copies.append(host.copy_(value.detach(), non_blocking=value.is_cuda))
            return host
        if isinstance(value, ShardedChunks):
            return ShardedChunks(value.global_shape, [(offsets, copy(t)) for offsets, t in value.chunks], value.dtype)
        if isinstance(value, dict):
            return {key: copy(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    staged = copy(state)
    if torch.cuda.is_available() and any(c.is_pinned() for c in copies):
        torch.cuda.synchronize()  # the non-blocking copies have landed before the training changes the state
    return staged


class AsyncCheckpointWriter:
    """One background save at a time over ``group`` (a whole-world gloo group only it uses; None in one process)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def start(self, state: dict[str, Any], save_dir: str | Path, iteration: int,
              on_commit: Callable[[Path, float], None] | None = None, **write_options: Any) -> float:
        """Wait for the previous save, stage ``state`` to host memory and write it in the background; returns the
        seconds the caller was held (the wait and the copy). ``on_commit(path, seconds)`` runs on the writer's thread
        after the commit (seconds: the write's own time)."""
        start = time.perf_counter()
        self.wait()
        staged = stage_to_host(state)

        def write() -> None:
            begin = time.perf_counter()
            try:
                path = write_checkpoint(staged, save_dir, iteration, group=self.group, **write_options)
                if on_commit is not None:
                    on_commit(path, time.perf_counter() - begin)
            except BaseException as error:  # noqa: BLE001 - raised on the training thread by the next wait()
                self._error = error

        self._thread = threading.Thread(target=write, name=f"megafp8-async-save-{iteration}", daemon=True)
        self._thread.start()
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the pending save is committed; raise its error (a CheckpointError) if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
