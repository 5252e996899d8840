"""Non-persistent checkpoints (Megatron-LM's --non-persistent-save-interval, --non-persistent-ckpt-type local|global,
--non-persistent-local-ckpt-dir, --non-persistent-global-ckpt-dir): frequent cheap saves between the persistent
ones, resumed from when newer than the newest persistent checkpoint and complete on every rank.

    local:  each rank writes its own state as it holds it (megafp8.checkpoint.local_checkpoint) to node-local
            storage: no collective, no resharding (a resume must keep the layout), one iteration kept per rank.
    global: the persistent format (reshardable, checksummed, committed by rank 0) in its own directory, keeping
            only the newest (Megatron-LM's default directory: --save/non_persistent).
On resume every rank agrees on the newest local iteration that is complete and intact on every rank; the run
resumes from it when it is newer than --load's newest checkpoint, else from --load, with one line saying which
and why.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from megafp8.checkpoint.atomic import read_tracker
from megafp8.checkpoint.coordination import all_gather_object
from megafp8.checkpoint.errors import CheckpointError
from megafp8.checkpoint.local_checkpoint import check_local, complete_iterations, load_local, save_local
from megafp8.checkpoint.rng import capture_rng_state, restore_rng_state

CKPT_TYPES = ("global", "local", "in_memory")


def add_non_persistent_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="also save every this many iterations to a non-persistent checkpoint (--non-persistent-"
                        "ckpt-type), resumed from when newer than --load's (docs/checkpoints.md)")
    g.add_argument("--non-persistent-ckpt-type", choices=CKPT_TYPES, default=None,
                   help="local: each rank's own state to --non-persistent-local-ckpt-dir (node-local, same layout "
                        "to resume); global: the persistent format to --non-persistent-global-ckpt-dir, one kept; "
                        "in_memory is not built")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="node-local directory of the local checkpoints (iter_NNNNNNN/rank_RRRRR.pt + .json)")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="directory of the global non-persistent checkpoints (default: --save/non_persistent)")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=("fully_parallel", "atomic"), default="fully_parallel",
                   help="accepted: every rank writes its own file, atomically, either way")


def non_persistent_errors(args: argparse.Namespace) -> list[str]:
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    errors = []
    if interval is not None and interval < 1:
        errors.append(f"--non-persistent-save-interval must be >= 1, got {interval}")
    if interval is not None and kind is None:
        errors.append("--non-persistent-save-interval needs --non-persistent-ckpt-type local or global")
    if kind == "in_memory":
        errors.append("--non-persistent-ckpt-type in_memory is not built (it keeps replicas in other nodes' memory, "
                      "NVIDIA Resiliency Extension's); use local (node-local files) or global")
    if kind == "local" and args.non_persistent_local_ckpt_dir is None:
        errors.append("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (node-local storage)")
    if interval is not None and args.save is None:
        errors.append("--non-persistent-save-interval needs --save (the persistent checkpoints they come between)")
    return errors


def global_dir(args: argparse.Namespace) -> str | None:
    if args.non_persistent_ckpt_type != "global":
        return None
    return args.non_persistent_global_ckpt_dir or (os.path.join(args.save, "non_persistent") if args.save else None)


def _layout(ps) -> dict:
    return {**dataclasses.asdict(ps.coords), "world_size": ps.world_size,
            "sizes": [ps.tp_size, ps.cp_size, ps.pp_size, ps.dp_size, ps.ep_size]}


def _host_copy(value):
    """A CPU copy with its own storage (a view into a flat buffer would save the whole buffer)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return value


def _released(tensor: torch.Tensor) -> bool:
    """A weight whose high-precision storage --fp8-param-gather released (a stride-0 stand-in): the optimizer's
    master weights hold its values, and the publish after a load writes it again."""
    return tensor.numel() > 1 and 0 in tensor.stride()


def local_state(checkpointer, trainer) -> dict:
    """This rank's whole training state as it holds it (what a same-layout resume needs)."""
    optimizer = checkpointer.optimizer
    optimizer.ddp.finish_param_sync()
    rng = capture_rng_state(checkpointer.chunks[0].rng)
    kind, keys, position, has_gauss, cached = rng["numpy"]  # numpy's state as tensors and numbers: weights-only loads
    rng["numpy"] = [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), position, has_gauss, cached]
    return _host_copy({
        "model": [{name: t for name, t in chunk.state_dict().items() if not _released(t)}
                  for chunk in checkpointer.chunks],
        "optimizer": optimizer.state_tensors(),
        "counters": optimizer.device_counters(),
        "guard": checkpointer.guard.state_dict() if checkpointer.guard is not None else None,
        "rng": rng,
        "progress": dataclasses.asdict(trainer.progress),
    })


def save_local_checkpoint(checkpointer, trainer) -> Path:
    args, ps = checkpointer.args, checkpointer.ps
    return save_local(args.non_persistent_local_ckpt_dir, trainer.progress.iteration, ps.rank,
                      local_state(checkpointer, trainer), _layout(ps))


def restore_local_state(checkpointer, state: dict) -> dict:
    """Put a ``local_state`` back into this rank's model and optimizer; returns the saved progress counters."""
    optimizer = checkpointer.optimizer
    for chunk, saved in zip(checkpointer.chunks, state["model"], strict=True):
        missing, unexpected = chunk.load_state_dict(saved, strict=False)
        current = chunk.state_dict()
        if unexpected or any(not _released(current[name]) for name in missing):
            raise CheckpointError(f"local checkpoint: the model's tensors differ from the saved ones (missing "
                                  f"{sorted(n for n in missing if not _released(current[n]))}, unexpected "
                                  f"{sorted(unexpected)}): a local checkpoint resumes the same model only")
    with torch.no_grad():
        for tensor, saved in zip(optimizer.state_tensors(), state["optimizer"], strict=True):
            tensor.copy_(saved)
        for name, tensor in optimizer.device_counters().items():
            tensor.copy_(state["counters"][name])
    if checkpointer.guard is not None and state["guard"] is not None:
        checkpointer.guard.load_state_dict(state["guard"], optimizer.ddp.module)
    rng = dict(state["rng"])
    kind, keys, position, has_gauss, cached = rng["numpy"]
    rng["numpy"] = (kind, keys.numpy().astype(np.uint32), position, has_gauss, cached)
    restore_rng_state(rng, checkpointer.chunks[0].rng)
    optimizer.publish()  # the restored master weights into the model, as a persistent load's apply does
    return state["progress"]


def agreed_local_iteration(args: argparse.Namespace, ps) -> tuple[int | None, str]:
    """(the newest local iteration complete and intact on every rank, or None; why). Every rank calls."""
    root = args.non_persistent_local_ckpt_dir
    everyone = all_gather_object(complete_iterations(root, ps.rank))
    common = set(everyone[0]).intersection(*everyone[1:])
    newest = max((i for mine in everyone for i in mine), default=None)
    if not common:
        if newest is None:
            return None, f"none in {root}"
        lacking = [rank for rank, mine in enumerate(everyone) if newest not in mine]
        return None, (f"iteration {newest} is not complete on every rank (rank {', '.join(map(str, lacking))} "
                      f"has no complete file for it in {root})")
    candidate = max(common)
    problems = [p for p in all_gather_object(check_local(root, candidate, ps.rank, _layout(ps))) if p]
    if problems:
        return None, f"iteration {candidate} cannot be loaded: {problems[0]}"
    if candidate != newest:
        return candidate, f"iteration {newest} is not complete on every rank; {candidate} is"
    return candidate, "complete on every rank"


def resume_source(args: argparse.Namespace, ps) -> tuple[str, int | None, str]:
    """Where to resume from: ("local", iteration, line), ("global", iteration, line), ("persistent", None, line
    or "") — the line, for rank 0, says which and why. Every rank calls (local: two object all-gathers)."""
    persistent = read_tracker(args.load) if args.load else None
    kind = args.non_persistent_ckpt_type
    if kind == "local":
        iteration, why = agreed_local_iteration(args, ps)
    elif kind == "global":
        directory = global_dir(args)
        iteration = read_tracker(directory) if directory else None
        why = "its newest" if iteration is not None else f"none in {directory}"
    else:
        return "persistent", None, ""
    newer = iteration is not None and (persistent is None or iteration > persistent)
    base = f"persistent iteration {persistent}" if persistent is not None else "no persistent checkpoint"
    if newer:
        return kind, iteration, (f" resuming from the {kind} non-persistent checkpoint of iteration {iteration} "
                                 f"({why}; newer than the {base})")
    reason = why if iteration is None else f"its iteration {iteration} is not newer than the {base}"
    target = f"the persistent checkpoint of iteration {persistent}" if persistent is not None else "iteration 0"
    return "persistent", None, f" {kind} non-persistent checkpoints: {reason}: resuming from {target}"


def load_local_checkpoint(checkpointer, iteration: int) -> dict:
    state = load_local(checkpointer.args.non_persistent_local_ckpt_dir, iteration, checkpointer.ps.rank)
    return restore_local_state(checkpointer, state)
