"""The training loop's side of checkpoints (--save, --load, --save-interval, --keep-last, --finetune,
--no-load-optim, --no-load-rng): what a run puts into megafp8.checkpoint and takes back out.

A checkpoint holds everything a bit-exact resume needs: the model chunks (with FP8 amax histories and
scales), the ZeRO optimizer's shards (master weights, moments, codec scales), the saturation guard's
switches, every RNG state, the data position (consumed samples) and the progress counters, --fp16's loss scale
(with the optimizer: --no-load-optim and --finetune start from --initial-loss-scale, as Megatron-LM), and the
flags. Saved at one TP/PP/DP layout it loads at any other (see docs/checkpoints.md). With --async-save the step
only copies that state to host memory and a background thread writes it (megafp8.checkpoint.async_save).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from megafp8.checkpoint import (distributed_optimizer_state, distributed_optimizer_template, load_checkpoint,
                                param_flat_range_state, save_checkpoint)
from megafp8.checkpoint.async_save import AsyncCheckpointWriter
from megafp8.checkpoint.coordination import run_agreed
from megafp8.checkpoint.save_load import checkpoint_state
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.non_persistent import global_dir, load_local_checkpoint, resume_source, save_local_checkpoint


class Checkpointer:
    """Saves and loads one rank's training state; every rank calls save/load together."""

    def __init__(self, args: argparse.Namespace, parallel_state: ParallelState, pipeline, optimizer, guard=None):
        self.args, self.ps, self.pipeline, self.optimizer, self.guard = args, parallel_state, pipeline, optimizer, guard
        self.async_writer = AsyncCheckpointWriter(_writer_group(args)) if getattr(args, "async_save", False) else None
        self.last_saved_iteration: int | None = None  # saved or loaded (a step re-run's exit saves only if new)

    @property
    def chunks(self):
        return self.pipeline.chunks

    def _released_weights(self) -> dict[str, tuple]:
        """FP8 layers' weights without high-precision storage (--fp8-param-gather): this rank's owned range
        of each, from the optimizer's master weights, as ``{name: (param, start, fp32 values)}``."""
        ddp = self.optimizer.ddp
        owned = self.optimizer.owned_master_weights()
        empty = torch.empty(0, device=ddp.grad_buffers[0].device)
        return {ddp.param_names[p]: owned.get(ddp.param_names[p], (p, 0, empty))  # a rank may own none of it
                for bucket in ddp.buckets if bucket.param_data is None for p in bucket.params}

    def _overrides(self, released: dict[str, tuple]) -> dict:
        vocab_size = self.chunks[0].config.vocab_size
        return {name: param_flat_range_state(values, start, param, self.ps.coords.tp, self.ps.tp_size, vocab_size)
                for name, (param, start, values) in released.items()}

    def _loss_scaler_state(self) -> dict:
        scaler = self.optimizer.loss_scaler
        if scaler is None:
            return {}
        return {"loss_scaler": {name: value.item() for name, value in scaler.state_dict().items()}}

    def _load_loss_scaler_state(self, saved: dict | None) -> None:
        """The saved scale and trackers (a checkpoint without them, e.g. from a bf16 run: the initial scale)."""
        scaler = self.optimizer.loss_scaler
        if scaler is None or saved is None:
            return
        state = scaler.state_dict()
        for name in state.keys() & saved.keys():  # a constant scaler saved the scale only
            state[name] = torch.tensor(saved[name], dtype=state[name].dtype)
        scaler.load_state_dict(state)

    def save_non_persistent(self, trainer) -> None:
        """--non-persistent-save-interval: this rank's own file (local) or the persistent format in its own
        directory, one kept (global); megafp8.training.non_persistent."""
        if self.args.non_persistent_ckpt_type == "local":
            path = save_local_checkpoint(self, trainer)
            if trainer.is_logging_rank:
                print(f" saved local checkpoint at iteration {trainer.progress.iteration} to {path.parent}", flush=True)
        else:
            self.save(trainer, directory=global_dir(self.args), keep_last=1)

    def save(self, trainer, directory: str | None = None, keep_last: int | None = None) -> None:
        """Write iteration `trainer.progress.iteration` to --save, or to ``directory`` keeping ``keep_last``
        (atomic; --keep-last prunes older ones)."""
        progress = trainer.progress
        if directory is None:
            self.last_saved_iteration = progress.iteration
        directory = directory or self.args.save
        keep_last = keep_last if keep_last is not None else self.args.keep_last
        # --overlap-param-gather defers the gather after the step to the next forward: finish it, or the
        # shards this rank does not own would be saved one step stale.
        self.optimizer.ddp.finish_param_sync()
        state = dict(parallel_state=self.ps,
                     optimizer_state=distributed_optimizer_state(self.optimizer, self.chunks, self.ps),
                     extra={"progress": asdict(progress), **self._loss_scaler_state()},
                     rng_tracker=self.chunks[0].rng, saturation_guard=self.guard,
                     model_overrides=self._overrides(self._released_weights()))
        write = dict(args=self.args, consumed_samples=progress.consumed_samples, keep_last=keep_last)
        if self.async_writer is None:
            path = save_checkpoint(directory, progress.iteration, model=self.chunks, **state, **write)
            if trainer.is_logging_rank:
                print(f" saved checkpoint at iteration {progress.iteration} to {path}", flush=True)
            return
        iteration, speaks = progress.iteration, trainer.is_logging_rank
        staged = run_agreed(lambda: checkpoint_state(self.chunks, **state), f"preparing checkpoint {iteration}")

        def committed(path, seconds: float) -> None:
            if speaks:
                print(f" saved checkpoint at iteration {iteration} to {path} (written in the background in "
                      f"{seconds:.1f} s)", flush=True)

        held = self.async_writer.start(staged, directory, iteration, on_commit=committed,
                                       parallel_state=self.ps, **write)
        if speaks:
            print(f" checkpoint at iteration {iteration} staged in host memory ({held:.2f} s); writing it in the "
                  "background (--async-save)", flush=True)

    def finish(self) -> None:
        """Wait for a pending asynchronous save to commit (before the process exits); raises if it failed."""
        if self.async_writer is not None:
            self.async_writer.wait()

    def resume(self) -> dict | None:
        """Restore from the newest of --load and the non-persistent checkpoints (megafp8.training.non_persistent);
        returns the saved progress counters (None: nothing to resume from)."""
        source, iteration, line = resume_source(self.args, self.ps)
        if line and self.ps.rank == 0:
            print(line, flush=True)
        if source == "local":
            progress = load_local_checkpoint(self, iteration)
            self.last_saved_iteration = iteration
            return progress
        if source == "global":
            return self.load(global_dir(self.args))
        return self.load()

    def load(self, directory: str | None = None) -> dict | None:
        """Restore from --load (or ``directory``); returns the saved progress counters (None: nothing to resume
        from). --finetune keeps only the weights (iteration 0, fresh optimizer and data position)."""
        args = self.args
        template, apply = distributed_optimizer_template(self.optimizer, self.chunks, self.ps)
        released = self._released_weights()  # loaded into these buffers, not into the parameters
        loaded = load_checkpoint(directory or args.load, model=self.chunks, parallel_state=self.ps, optimizer_state=template,
                                 rng_tracker=self.chunks[0].rng, saturation_guard=self.guard, args=args,
                                 finetune=args.finetune, no_load_optim=args.no_load_optim or args.finetune,
                                 no_load_rng=args.no_load_rng or args.finetune,
                                 allow_changed_args=args.allow_changed_args or (),
                                 model_overrides=self._overrides(released))
        if loaded is None:  # Megatron's rule (--load = --save on a first run), but said: a typo'd path shows
            if self.ps.rank == 0:
                print(f" no checkpoint in {directory or args.load}: starting from iteration 0", flush=True)
            return None
        if loaded.optimizer_loaded:
            apply()  # publishes the loaded master weights into the model
            self._load_loss_scaler_state(loaded.extra.get("loss_scaler"))
        else:  # the loaded weights become the master weights
            self.optimizer.reload_master_weights({name: values for name, (_, _, values) in released.items()})
        if self.ps.rank == 0:
            for message in loaded.messages:
                print(f" checkpoint: {message}", flush=True)
            print(f" loaded checkpoint {loaded.path} (iteration {loaded.iteration})", flush=True)
        if args.finetune:
            return None
        self.last_saved_iteration = loaded.iteration
        return loaded.extra.get("progress")


def _writer_group(args: argparse.Namespace) -> dist.ProcessGroup | None:
    """The background writer's own whole-world gloo group (created by every rank together, here): sharing a
    communicator with the training thread's collectives would interleave the two threads' messages."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(minutes=args.distributed_timeout_minutes))
