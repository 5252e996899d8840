"""Checkpoints: sharded save/load on torch.distributed.checkpoint with global offsets (reshard on load),
atomic commit, and the pieces the training loop and the conversion tools share (see docs/checkpoints.md).

The names below load their module on first use: torch.distributed.checkpoint (and the DTensor ops it imports) costs
~0.65 s of every process's start, which a run that neither saves nor loads need not pay."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ArgsMismatchError": "args_check", "args_to_dict": "args_check", "check_args": "args_check",
    "MANIFEST_FILE": "atomic", "TRACKER_FILE": "atomic", "iteration_dir": "atomic", "read_tracker": "atomic",
    "CheckpointError": "errors",
    "checkpoint_key": "model_state", "model_checkpoint_state": "model_state",
    "distributed_optimizer_state": "optimizer_state", "distributed_optimizer_template": "optimizer_state",
    "capture_rng_state": "rng", "restore_rng_state": "rng",
    "LoadedCheckpoint": "save_load", "load_checkpoint": "save_load", "save_checkpoint": "save_load",
    "ShardedChunks": "sharded_tensor", "flat_range_state": "sharded_tensor", "flat_sharded_state": "sharded_tensor",
    "param_flat_range_state": "sharded_tensor", "tensor_parallel_state": "sharded_tensor",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # once
    return value
