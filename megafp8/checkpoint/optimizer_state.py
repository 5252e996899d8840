"""The ZeRO distributed optimizer's state in global coordinates, so it reshards over TP and DP on load.

``DistributedOptimizer.state_dict()`` holds, per parameter fragment this rank owns, the flat range
``[start, end)`` of the parameter's (TP-shard) flattened index and the codec tensors of that range:
per-element ones (fp32/bf16 values, FP8 codes) and per-128-group ones (FP8 amax, exponent). Here:

- per-element tensors become ``param_flat_range_state`` chunks in the parameter's global shape: they
  reload at any TP and DP size (vocab-padding rows are left out, as in the model state);
- per-group tensors and the fp16 master's per-tensor scale depend on the TP shard they were computed
  on: they are keyed by TP size and rank and reshard over DP only (loading FP8 / fp16-coded optimizer
  state at another TP size fails with the missing key named; fp32 and bf16 states reshard freely);
- the tied embedding's copy on the last pipeline stage is saved once, as ``embedding.weight`` (the first
  stage's copy holds the same state; their ZeRO ranges differ, so both cannot be written).

Saving: ``optimizer_state=distributed_optimizer_state(opt, model, ps)``. Loading:
``template, apply = distributed_optimizer_template(opt, model, ps)``, ``load_checkpoint(...,
optimizer_state=template)``, then ``apply()`` if ``optimizer_loaded``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megafp8.checkpoint.errors import CheckpointError
from megafp8.checkpoint.model_state import checkpoint_key
from megafp8.checkpoint.sharded_tensor import flat_range_state, param_flat_range_state
from megafp8.parallel.parallel_state import ParallelState

GROUP = 128  # elements per codec group (megafp8.optim.state_codec.GROUP); fragments start on a group boundary
SCALARS = ("step", "skipped_steps", "master_weight_dtype", "optimizer_state_dtype")
RANGE_KEYS = ("start", "end", "numel")


def _named_params(model: nn.Module | Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    return {name: p for chunk in chunks for name, p in chunk.named_parameters()}


def _vocab_size(model: nn.Module | Sequence[nn.Module]) -> int | None:
    first = model if isinstance(model, nn.Module) else model[0]
    return getattr(getattr(first, "config", None), "vocab_size", None)


def _global_state(optimizer_state: dict[str, Any], model: nn.Module | Sequence[nn.Module], ps: ParallelState,
                  saving: bool) -> dict[str, Any]:
    params, vocab_size = _named_params(model), _vocab_size(model)
    tp_rank, tp_size = ps.coords.tp, ps.tp_size
    group_coords = ps.group_coordinates()  # (index, size) per named group: how placements shard
    out: dict[str, Any] = {"params": {}}
    for key in SCALARS:
        out[key] = optimizer_state[key]
    for name, entry in optimizer_state["fragments"].items():
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"optimizer state names parameter {name!r}, which the model chunks do not hold")
        if saving and getattr(param, "shared_embedding", False) and ps.pp_size > 1:
            continue  # the first stage saves the tied embedding's state
        start, end = entry["start"], entry["end"]
        tensors: dict[str, Any] = {}
        for field, tensor in entry.items():
            if field in RANGE_KEYS:
                continue
            if field == "master_scale":
                if optimizer_state["master_weight_dtype"] == "fp32":
                    continue  # unused (always 1) with fp32 master weights: keep fp32 states TP-reshardable
                tensors[f"master_scale.tp{tp_size}.rank{tp_rank}"] = tensor
            elif tensor.numel() == end - start:
                tensors[field] = param_flat_range_state(tensor, start, param, tp_rank, tp_size, vocab_size,
                                                        group_coords=group_coords)
            else:  # one entry per 128-element group of this TP shard's flat index
                groups = -(-param.numel() // GROUP)
                tensors[f"{field}.tp{tp_size}.rank{tp_rank}"] = flat_range_state(tensor, start // GROUP, groups)
        out["params"][checkpoint_key(name, param)] = _merge(out["params"].get(checkpoint_key(name, param)), tensors)
    return out


def _merge(existing: dict | None, new: dict) -> dict:
    """A V-schedule rank holds the tied embedding once; two distinct fragments never share a key."""
    if existing is not None and existing.keys() & new.keys():
        raise CheckpointError("optimizer state: two fragments map to one checkpoint entry")
    return {**(existing or {}), **new}


def distributed_optimizer_state(optimizer: Any, model: nn.Module | Sequence[nn.Module],
                                parallel_state: ParallelState) -> dict[str, Any]:
    """``optimizer``'s state (a ``megafp8.optim.DistributedOptimizer``) for ``save_checkpoint``."""
    return _global_state(optimizer.state_dict(), model, parallel_state, saving=True)


def distributed_optimizer_template(optimizer: Any, model: nn.Module | Sequence[nn.Module],
                                   parallel_state: ParallelState) -> tuple[dict[str, Any], Callable[[], None]]:
    """(template for ``load_checkpoint(optimizer_state=...)``, a function that hands the loaded values to
    ``optimizer.load_state_dict``). The template covers exactly the ranges this rank owns at this layout."""
    own = optimizer.state_dict()
    template = _global_state(own, model, parallel_state, saving=False)

    def apply() -> None:
        for key in SCALARS:  # python leaves are replaced in the template by load_checkpoint
            own[key] = template[key]
        try:
            optimizer.load_state_dict(own)
        except ValueError as e:
            raise CheckpointError(f"optimizer state from the checkpoint does not fit this run: {e}") from None

    return template, apply
