"""save_checkpoint / load_checkpoint: what the training loop calls, on every rank, at any layout.

One checkpoint holds the model (layout-free names, TP shards at global offsets), the optimizer state
(an opaque nested dict whose sharded tensors are ``ShardedChunks``), every RNG state (per rank), the
FP8 saturation guard's switches, the data position, the flags, and any replicated extra state (LR
schedule, counters). It is written with torch.distributed.checkpoint into a temporary directory,
checksummed, fsynced, committed by rename, and only then named in ``latest_checkpointed_iteration.txt``.
Loading runs no code from the files (``safe_dcp``): a checkpoint someone else published is data, not a program.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import time
import uuid
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex

from megafp8.checkpoint import atomic
from megafp8.checkpoint.args_check import args_to_dict, check_args
from megafp8.checkpoint.coordination import all_gather_object, broadcast_object, run_agreed, world
from megafp8.checkpoint.errors import CheckpointError
from megafp8.checkpoint.manifest import check_file, digest_file, read_manifest, write_manifest
from megafp8.checkpoint.model_state import model_checkpoint_state, zero_vocab_padding_
from megafp8.checkpoint.rng import capture_rng_state, restore_rng_state
from megafp8.checkpoint.safe_dcp import SafeFileSystemReader, check_plain, entry_source, load_plain, read_metadata
from megafp8.checkpoint.sharded_tensor import ShardedChunks, ShardedLoadPlanner, ShardedSavePlanner
from megafp8.fp8 import ScalingState
from megafp8.parallel.parallel_state import ParallelState

Models = nn.Module | Sequence[nn.Module]
FP8_SCALING_MARK = ".fp8_scaling."  # the ScalingState submodules' buffers (amax histories, scales)

# Seconds rank 0 waits between writing every shard and committing the checkpoint. Only for tests that
# kill a rank inside that window (the crash-safety guarantee is about exactly this moment).
PAUSE_BEFORE_COMMIT_ENV = "MEGAFP8_TEST_PAUSE_BEFORE_COMMIT_S"


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored. ``iteration`` and ``consumed_samples`` are 0 under finetune."""

    path: Path
    iteration: int
    consumed_samples: int
    saved_args: dict[str, Any]
    saved_layout: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)
    optimizer_loaded: bool = False
    rng_restored: bool = False
    messages: list[str] = field(default_factory=list)  # for the log (e.g. why RNG states were not restored)


def _layout(ps: ParallelState) -> dict[str, int]:
    return {"tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
            "data_parallel_size": ps.dp_size, "context_parallel_size": ps.cp_size, "world_size": ps.world_size}


def _to_bytes(obj: Any, what: str) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    check_plain(buffer.getvalue(), what)  # what _from_bytes would refuse fails this save, not the resume
    return buffer.getvalue()


def _from_bytes(data: bytes, source: str) -> dict[str, Any]:
    """A state dict megafp8 pickled (RNG tuples and numpy arrays, guard and extra state) as plain data only."""
    if not isinstance(data, bytes):
        raise CheckpointError(f"{source} holds a {type(data).__name__}, not the bytes megafp8 writes")
    value = load_plain(data, source)
    if not isinstance(value, dict):
        raise CheckpointError(f"{source} holds a {type(value).__name__}, not the dict megafp8 writes")
    return value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialized: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_key(rank: int) -> str:
    return f"rank{rank:05d}"


def _summarize(error: BaseException) -> str:
    """One line per failing rank from DCP's CheckpointException (whose str is every rank's traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:
        lines = []
        for rank, failure in sorted(failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            last_line = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            kind = "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "  # ours name the file
            lines.append(f"rank {rank}: {kind}{last_line}")
        return "; ".join(dict.fromkeys(lines))
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}"


def save_checkpoint(save_dir: str | Path, iteration: int, *, model: Models, parallel_state: ParallelState,
                    optimizer_state: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                    args: argparse.Namespace | Mapping[str, Any] | None = None, consumed_samples: int = 0,
                    rng_tracker: Any | None = None, saturation_guard: Any | None = None,
                    keep_last: int | None = None, model_overrides: Mapping[str, ShardedChunks] | None = None,
                    writer_options: Mapping[str, Any] | None = None) -> Path:
    """Write ``<save_dir>/iter_{iteration:07d}`` atomically and point the tracker at it. Call on every rank.

    ``optimizer_state``: nested dict; ``ShardedChunks`` leaves are sharded (global offsets), plain tensors
    and python values replicated (saved once). ``extra``: replicated python state (identical on every
    rank). ``keep_last``: afterwards delete all but the newest N committed checkpoints. ``model_overrides``:
    see ``model_checkpoint_state`` (parameters whose values live elsewhere, e.g. ZeRO master weights).
    ``writer_options``: extra ``dcp.FileSystemWriter`` arguments (the converter passes
    ``per_thread_copy_ahead=0`` so DCP asks for one tensor at a time and writes it before the next).
    Returns the committed directory. Raises CheckpointError (on every rank) if any rank fails."""
    state = run_agreed(lambda: checkpoint_state(model, parallel_state, optimizer_state, extra, rng_tracker,
                                                saturation_guard, model_overrides),
                       f"preparing checkpoint {atomic.iteration_dir(Path(save_dir), iteration)}")
    return write_checkpoint(state, save_dir, iteration, parallel_state=parallel_state, args=args,
                            consumed_samples=consumed_samples, keep_last=keep_last, writer_options=writer_options)


def checkpoint_state(model: Models, parallel_state: ParallelState, optimizer_state: Mapping[str, Any] | None = None,
                     extra: Mapping[str, Any] | None = None, rng_tracker: Any | None = None,
                     saturation_guard: Any | None = None,
                     model_overrides: Mapping[str, ShardedChunks] | None = None) -> dict[str, Any]:
    """What a checkpoint holds, as DCP's state dict of views of the live state (no collective, no copy)."""
    rank = world()[0]
    state: dict[str, Any] = {"model": model_checkpoint_state(model, parallel_state, overrides=model_overrides),
                             "rng": {_rank_key(rank): _to_bytes(capture_rng_state(rng_tracker), "RNG state")},
                             "extra": _to_bytes(dict(extra or {}), "extra")}
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    if saturation_guard is not None:
        state["fp8_guard"] = {_rank_key(rank): _to_bytes(saturation_guard.state_dict(), "saturation guard state")}
    return state


def write_checkpoint(state: dict[str, Any], save_dir: str | Path, iteration: int, *, parallel_state: ParallelState,
                     args: argparse.Namespace | Mapping[str, Any] | None = None, consumed_samples: int = 0,
                     keep_last: int | None = None, writer_options: Mapping[str, Any] | None = None,
                     group: dist.ProcessGroup | None = None) -> Path:
    """Write ``state`` (checkpoint_state's, or a staged copy of it) as ``save_checkpoint`` does; every collective goes
    over ``group`` (None: the default group; an asynchronous save's thread passes the checkpoint gloo group)."""
    if iteration < 0:
        raise CheckpointError(f"save_checkpoint: iteration must be >= 0, got {iteration}")
    root = Path(save_dir)
    rank, size = world(group)
    token = broadcast_object(uuid.uuid4().hex if rank == 0 else None, group=group)  # one temporary dir for all ranks
    tmp, final = atomic.temporary_dir(root, iteration, token), atomic.iteration_dir(root, iteration)

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            atomic.remove_stale_temporaries(root)
            tmp.mkdir()

    run_agreed(prepare, f"preparing checkpoint {final}", group)
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, **(writer_options or {})),
                     planner=ShardedSavePlanner(), process_group=group, no_dist=size == 1)
    except (Exception, dcp.CheckpointException) as e:  # DCP raises the same CheckpointException on every rank
        raise CheckpointError(f"writing checkpoint {final} failed: {_summarize(e)}") from None

    def digest_share() -> dict[str, dict[str, Any]]:
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        return {name: digest_file(tmp / name) for name in names[rank::size]}

    digests = all_gather_object(run_agreed(digest_share, f"checksumming {tmp}", group), group)

    def commit() -> None:
        if rank != 0:
            return
        if os.environ.get(PAUSE_BEFORE_COMMIT_ENV):  # test hook: hold the crash window open (tests/test_training_3d.py)
            time.sleep(float(os.environ[PAUSE_BEFORE_COMMIT_ENV]))
        files = {name: entry for share in digests for name, entry in share.items()}
        write_manifest(tmp, {"iteration": iteration, "consumed_samples": consumed_samples,
                             "layout": _layout(parallel_state), "args": args_to_dict(args), "files": files,
                             "contents": sorted(state), "torch_version": torch.__version__})
        atomic.commit_directory(tmp, final)
        atomic.write_text_atomic(root / atomic.TRACKER_FILE, f"{iteration}\n")
        if keep_last is not None:
            atomic.prune_checkpoints(root, keep_last, protect=iteration)

    run_agreed(commit, f"committing checkpoint {final}", group)
    return final


def read_entries(state: dict[str, Any], path: Path) -> None:
    """One process's ``dcp.load`` of ``state`` (tensors filled in place, byte items replaced) from the committed
    checkpoint ``path``, running no code from its files: the conversion tools' reader. Raises CheckpointError."""
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=ShardedLoadPlanner(checkpoint_dir=path),
                     no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException carrying every traceback
        raise CheckpointError(f"reading checkpoint {path} failed: {_summarize(e)}") from None


def _resolve_iteration(root: Path, iteration: int | None) -> int | None:
    if iteration is not None:
        return iteration
    return atomic.read_tracker(root)


def load_checkpoint(load_dir: str | Path, *, model: Models, parallel_state: ParallelState,
                    optimizer_state: Mapping[str, Any] | None = None, rng_tracker: Any | None = None,
                    saturation_guard: Any | None = None, args: argparse.Namespace | Mapping[str, Any] | None = None,
                    iteration: int | None = None, finetune: bool = False, no_load_optim: bool = False,
                    no_load_rng: bool = False, allow_changed_args: Collection[str] = (),
                    verify: bool = True,
                    model_overrides: Mapping[str, ShardedChunks] | None = None) -> LoadedCheckpoint | None:
    """Load the checkpoint the tracker names (or ``iteration``) into the live model / optimizer state, at
    this run's layout (TP/PP/DP may differ from the saved one). Call on every rank.

    Returns None when ``load_dir`` holds no tracker file (Megatron: start from scratch). ``optimizer_state``
    is a template built like the saved one at this layout; its tensors are filled in place and its python
    leaves replaced (read them back from the same dict). ``finetune``: weights only, iteration 0.
    ``verify``: check every file's SHA-256 (sizes are always checked). Raises CheckpointError."""
    root = Path(load_dir)
    rank, size = world()
    found = broadcast_object(run_agreed(lambda: _resolve_iteration(root, iteration) if rank == 0 else None,
                                        f"reading {root / atomic.TRACKER_FILE}"))
    if found is None:
        return None
    path = atomic.iteration_dir(root, found)
    manifest = run_agreed(lambda: read_manifest(path), f"reading {path}")

    def verify_share() -> None:
        names = sorted(manifest["files"])
        problems = [p for name in names[rank::size]
                    if (p := check_file(path, name, manifest["files"][name], hash_contents=verify))]
        if problems:
            raise CheckpointError("checkpoint is damaged; resume from an older one by writing its iteration into "
                                  f"{root / atomic.TRACKER_FILE}:\n  " + "\n  ".join(problems))

    run_agreed(verify_share, f"verifying {path}")
    saved_layout, saved_args, contents = manifest["layout"], manifest.get("args", {}), set(manifest["contents"])
    load_optim = optimizer_state is not None and not (finetune or no_load_optim)
    same_layout = {"context_parallel_size": 1, **saved_layout} == _layout(parallel_state)  # CP 1 before CP existed
    load_rng = not (finetune or no_load_rng) and same_layout
    messages = []
    if not (finetune or no_load_rng) and not same_layout:
        messages.append(f"RNG states not restored: saved at {saved_layout}, loading at {_layout(parallel_state)} "
                        "(per-rank streams do not map across layouts)")

    def plan() -> dict[str, Any]:
        if args is not None and saved_args:
            check_args(saved_args, args_to_dict(args), finetune=finetune, allow_changed=allow_changed_args,
                       checkpoint=str(path))
        if load_optim and "optimizer" not in contents:
            raise CheckpointError(f"{path} has no optimizer state; start from its weights with --finetune, "
                                  "or skip the optimizer with --no-load-optim")
        model_state = model_checkpoint_state(model, parallel_state, params_only=finetune, overrides=model_overrides)
        metadata = read_metadata(path)  # the restricted unpickler: a crafted file is refused before anything runs
        saved_keys = metadata.state_dict_metadata.keys()
        # FP8 turned on for a resumed BF16 run: scaling states the checkpoint lacks start cold, as in a new run.
        cold = [key for key in model_state if FP8_SCALING_MARK in key and f"model.{key}" not in saved_keys]
        for key in cold:
            del model_state[key]
        if cold:
            messages.append(f"{len(cold)} FP8 scaling tensors are not in {path}: "
                            "those delayed-scaling states start cold")
        state: dict[str, Any] = {"model": model_state}
        if load_optim:
            state["optimizer"] = optimizer_state
        if load_rng:
            state["rng"] = {_rank_key(rank): b""}
        if not finetune:
            state["extra"] = b""
            if saturation_guard is not None and "fp8_guard" in contents:
                state["fp8_guard"] = {_rank_key(r): b"" for r in range(saved_layout["world_size"])}
        _raise_if_missing(state, saved_keys, path, saved_layout)
        return state, metadata

    state, metadata = run_agreed(plan, f"loading {path}")
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(path),
                     planner=ShardedLoadPlanner(checkpoint_dir=path), no_dist=size == 1)
    except (Exception, dcp.CheckpointException) as e:  # a BaseException, raised on every rank alike
        raise CheckpointError(f"loading checkpoint {path} failed: {_summarize(e)}") from None

    def restore() -> LoadedCheckpoint:
        zero_vocab_padding_(model, parallel_state)
        for chunk in ([model] if isinstance(model, nn.Module) else model):
            for module in chunk.modules():
                if isinstance(module, ScalingState):  # DCP wrote the histories in place, bypassing load_state_dict
                    module.history_loaded()

        def source(key: str) -> str:  # the file an item came from, for the error a tampered item gives
            return entry_source(path, metadata, MetadataIndex(key))

        if load_rng:
            key = _rank_key(rank)
            restore_rng_state(_from_bytes(state["rng"][key], source(f"rng.{key}")), rng_tracker)
        if "fp8_guard" in state:
            _restore_guard(saturation_guard, [_from_bytes(data, source(f"fp8_guard.{key}"))
                                              for key, data in state["fp8_guard"].items()], model)
        return LoadedCheckpoint(
            path=path, iteration=0 if finetune else manifest["iteration"],
            consumed_samples=0 if finetune else manifest.get("consumed_samples", 0), saved_args=saved_args,
            saved_layout=saved_layout, extra={} if finetune else _from_bytes(state["extra"], source("extra")),
            optimizer_loaded=load_optim, rng_restored=load_rng, messages=messages)

    return run_agreed(restore, f"restoring state from {path}")


def _raise_if_missing(state: dict[str, Any], saved_keys: Collection[str], path: Path, saved_layout: dict) -> None:
    """Name the entries this run needs that the checkpoint lacks (DCP would report only the first, per rank)."""
    missing = [key for key in flatten_state_dict(state)[0] if key not in saved_keys]
    if not missing:
        return
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    hint = ""
    if any(re.search(r"\.tp\d+\.rank\d+$", key) for key in missing):
        hint = (f"\nFP8/fp16-coded optimizer state (per-group scales, the fp16 master scale) reshards over DP only: "
                f"it was saved at --tensor-model-parallel-size {saved_layout['tensor_model_parallel_size']}; load it "
                "at that size, or start the optimizer afresh with --no-load-optim")
    raise CheckpointError(f"{path} lacks {len(missing)} entries this run needs: {shown}{hint}")


def _restore_guard(guard: Any, rank_states: list[dict], model: Models) -> None:
    """Merge every saved rank's guard state (each holds its own pipeline stage's layers, under global
    names) and keep the switches of the layers this rank's model chunks hold, with their steps down the ladder
    (FP4 -> FP8 -> high precision) and the kurtosis warning's windows (--fp8-saturation-guard-kurtosis)."""
    strikes: dict[str, int] = {}
    switched: set[str] = set()
    demotions: dict[str, int] = {}
    kurtosis = {"history": {}, "warned": set()}
    for state in rank_states:
        strikes.update(state.get("strikes", {}))
        switched.update(state.get("switched", []))
        demotions.update(state.get("demotions", {}))
        if "kurtosis_warning" in state:
            kurtosis["history"].update(state["kurtosis_warning"]["history"])
            kurtosis["warned"].update(state["kurtosis_warning"]["warned"])
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    held = {name for chunk in chunks for name, _ in chunk.named_modules()}  # this rank's layers, every chunk's
    for chunk in chunks:
        mine = switched & {name for name, _ in chunk.named_modules()}
        merged = {"strikes": strikes, "switched": sorted(mine),
                  "demotions": {name: demotions[name] for name in mine if name in demotions}}
        if kurtosis["history"]:
            merged["kurtosis_warning"] = {
                "history": {name: values for name, values in kurtosis["history"].items() if name in held},
                "warned": sorted(kurtosis["warned"] & held)}
        guard.load_state_dict(merged, chunk)
