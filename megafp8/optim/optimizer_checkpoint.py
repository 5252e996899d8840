"""The distributed optimizer's state as a checkpoint takes it: per owned fragment, its slices of the master and the
moments copied one at a time onto the host (a save adds no device memory), and loaded back by re-slicing at any DP size.

The state dict addresses each fragment by parameter name and flat ``[start, end)``: a checkpoint saved at one DP size
loads at another (codec groups are 128-aligned in every parameter, so they never straddle shards).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megafp8.optim.state_codec import GROUP

if TYPE_CHECKING:
    from megafp8.optim.distributed_optimizer import DistributedOptimizer

CODECS = ("master", "exp_avg", "exp_avg_sq")


def copy_to(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A compact copy of ``tensor`` on ``device``, written straight there (no staging copy on the tensor's own
    device; pageable host memory: DCP records pinning in the checkpoint's metadata, and pinned blocks stay cached)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device).copy_(tensor)


def optimizer_state_dict(opt: DistributedOptimizer, device: torch.device | str = "cpu") -> dict:
    """``opt``'s shard as copies on ``device`` (see ``DistributedOptimizer.state_dict``)."""
    fragments = {}
    for frag in opt.fragments:
        entry = {"start": frag.param_lo, "end": frag.param_hi, "numel": frag.param.numel(),
                 "master_scale": copy_to(opt.master_scale[frag.index], device)}
        for prefix in CODECS:
            codec = getattr(opt, prefix)
            for key, t in codec.tensors().items():
                entry[f"{prefix}.{key}"] = copy_to(slice_storage(t, codec.numel, frag.storage_lo, frag.numel), device)
        fragments[frag.name] = entry
    return {"step": opt.step_count, "skipped_steps": opt.skipped_steps, "fragments": fragments,
            "master_weight_dtype": opt.master_weight_dtype, "optimizer_state_dtype": opt.optimizer_state_dtype}


@torch.no_grad()
def load_optimizer_state_dicts(opt: DistributedOptimizer, state_dicts: list[dict]) -> None:
    """Write the saving run's state dicts (every DP rank's, same TP/PP position, tensors on any device) into
    ``opt``'s storage, re-slicing each fragment to the range this rank owns; nothing is published."""
    for sd in state_dicts:
        saved = (sd["master_weight_dtype"], sd["optimizer_state_dtype"])
        if saved != (opt.master_weight_dtype, opt.optimizer_state_dtype):
            raise ValueError(f"optimizer checkpoint has --master-weight-dtype {sd['master_weight_dtype']} and "
                             f"--optimizer-state-dtype {sd['optimizer_state_dtype']}; this run uses "
                             f"{opt.master_weight_dtype} and {opt.optimizer_state_dtype}")
    opt.step_count, opt.skipped_steps = state_dicts[0]["step"], state_dicts[0]["skipped_steps"]
    for frag in opt.fragments:
        covered = 0
        for sd in state_dicts:
            old = sd["fragments"].get(frag.name)
            if old is None or old["end"] <= frag.param_lo or old["start"] >= frag.param_hi:
                continue
            lo, hi = max(old["start"], frag.param_lo), min(old["end"], frag.param_hi)
            covered += hi - lo
            opt.master_scale[frag.index] = old["master_scale"]
            for prefix in CODECS:
                codec = getattr(opt, prefix)
                for key, t in codec.tensors().items():
                    src = slice_storage(old[f"{prefix}.{key}"], old["end"] - old["start"], lo - old["start"], hi - lo,
                                        per_group=t.numel() != codec.numel)
                    slice_storage(t, codec.numel, frag.storage_lo + lo - frag.param_lo, hi - lo).copy_(src)
        if covered != frag.numel:
            raise ValueError(f"optimizer checkpoint covers {covered} of the {frag.numel} elements of {frag.name} "
                             f"[{frag.param_lo}, {frag.param_hi}) this rank owns: pass every DP rank's state dict")


def slice_storage(t: torch.Tensor, numel: int, start: int, n: int, per_group: bool | None = None) -> torch.Tensor:
    """Elements ``[start, start + n)`` of a per-element tensor, or their groups of a per-group one."""
    if per_group is None:
        per_group = t.numel() != numel
    if per_group:
        return t[start // GROUP: -(-(start + n) // GROUP)]
    return t[start:start + n]
