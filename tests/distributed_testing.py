"""Run a test body in N fresh gloo processes on CPU; a failure in any child fails the test with its traceback.

Usage (the body must be a module-level function so the spawned children can import it)::

    def _body(rank: int, world_size: int, extra) -> None: ...   # asserts inside

    @pytest.mark.distributed
    def test_x():
        run_distributed(_body, world_size=2, args=(extra,))

Rendezvous goes through a file in a fresh temporary directory (no ports to race for). Each child
uses one intra-op thread: the test machines have 2 cores and worlds of up to 4 processes.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist


def _child(body: Callable[..., None], rank: int, world_size: int, init_file: str, error_dir: str,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        body(rank, world_size, *args)
        # Keep every rank's process group alive until all bodies finished their collectives.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(error_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1)
    # The body passed: leave now. Interpreter teardown can abort ("terminate called without an active
    # exception", SIGABRT) on threads gloo leaves behind, which would fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(body: Callable[..., None], world_size: int, args: tuple[Any, ...] = (),
                    timeout_s: float = 180.0) -> None:
    """Call ``body(rank, world_size, *args)`` in ``world_size`` spawned processes with gloo initialized."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megafp8_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(body, rank, world_size, init_file, tmp, args), daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failed = False
        while any(p.is_alive() for p in procs):
            # One failed rank leaves its peers blocked in a collective: stop waiting for them.
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                failed = True
                break
            time.sleep(0.05)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        errors = sorted(Path(tmp).glob("rank*.txt"))
        if errors or failed or any(p.exitcode != 0 for p in procs):
            report = "\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors)
            timed_out = time.monotonic() > deadline
            pytest.fail(f"distributed test failed (world size {world_size}"
                        f"{', timed out after %.0f s' % timeout_s if timed_out and not errors else ''}; "
                        f"exit codes {[p.exitcode for p in procs]}):\n{report}", pytrace=False)
