"""Checkpoints: sharded save/load on torch.distributed.checkpoint with global offsets (reshard on load),
atomic commit, and the pieces the training loop and the conversion tools share (see docs/checkpoints.md)."""
from megafp8.checkpoint.args_check import ArgsMismatchError, args_to_dict, check_args
from megafp8.checkpoint.atomic import MANIFEST_FILE, TRACKER_FILE, iteration_dir, read_tracker
from megafp8.checkpoint.errors import CheckpointError
from megafp8.checkpoint.model_state import checkpoint_key, model_checkpoint_state
from megafp8.checkpoint.optimizer_state import distributed_optimizer_state, distributed_optimizer_template
from megafp8.checkpoint.rng import capture_rng_state, restore_rng_state
from megafp8.checkpoint.save_load import LoadedCheckpoint, load_checkpoint, save_checkpoint
from megafp8.checkpoint.sharded_tensor import (ShardedChunks, flat_range_state, flat_sharded_state,
                                               param_flat_range_state, tensor_parallel_state)

__all__ = ["ArgsMismatchError", "CheckpointError", "checkpoint_key", "LoadedCheckpoint", "MANIFEST_FILE", "ShardedChunks", "TRACKER_FILE",
           "args_to_dict", "capture_rng_state", "check_args", "distributed_optimizer_state",
           "distributed_optimizer_template", "flat_range_state", "flat_sharded_state",
           "iteration_dir", "load_checkpoint", "model_checkpoint_state", "param_flat_range_state", "read_tracker",
           "restore_rng_state", "save_checkpoint", "tensor_parallel_state"]
