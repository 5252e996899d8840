"""Run a benchmark's measurement on N gloo processes on CPU and hand back rank 0's (JSON-able) result."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_gloo(measure: Callable, nprocs: int, args) -> object:
    """`measure(rank, args)` runs on every rank inside an initialised gloo process group (one thread each:
    byte counts do not depend on the device or thread count); rank 0's return value comes back."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(measure, nprocs, os.path.join(tmp, "rendezvous"), args, out_file), nprocs=nprocs)
        with open(out_file) as f:
            return json.load(f)


def _worker(rank: int, measure: Callable, world_size: int, init_file: str, args, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result = measure(rank, args)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
