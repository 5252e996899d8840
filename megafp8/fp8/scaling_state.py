"""Delayed-scaling state: per-role amax histories and scales, updated once per step with ONE all-reduce.

Each FP8 tensor role of each layer (input, weight, grad_output) owns a ScalingState: its scale is used
for every micro-batch of the step, and the amaxes those micro-batches observe are folded into
`pending_amax`. At the end of the step Fp8ScalingManager.update() stacks every pending amax of the
model into one tensor, max-reduces it over the TP x DP group in a single collective (so all ranks end
with identical scales), rolls each history and computes the new scales (TransformerEngine's rule):

    amax  = max(history)  or  history[0] (most_recent)
    scale = FP8_MAX / amax / 2**margin      (kept unchanged when amax is 0 or not finite)

Histories and scales are buffers, so they are part of the model's state dict and of checkpoints.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from megafp8_kernels import fp8_format

from .recipe import Fp8Recipe


class ScalingState(nn.Module):
    """Amax history (index 0 = most recent) and current quantization scale of one FP8 tensor role."""

    def __init__(self, recipe: Fp8Recipe, fp8_dtype: torch.dtype):
        super().__init__()
        self.recipe = recipe
        self.fp8_max = fp8_format(fp8_dtype).max
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len))
        self.register_buffer("scale", torch.ones(()))  # TransformerEngine starts from 1 too
        self.register_buffer("pending_amax", torch.zeros(()), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() must not round histories and scales: keep them fp32 on any device.
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    @torch.no_grad()
    def observe(self, amax: torch.Tensor) -> None:
        """Fold one micro-batch's amax into this step's (no host sync: stays a device tensor)."""
        torch.maximum(self.pending_amax, amax.reshape(()).to(self.pending_amax), out=self.pending_amax)

    def extra_repr(self) -> str:
        return f"history={self.recipe.amax_history_len}, algo={self.recipe.amax_compute_algo}, margin={self.recipe.margin}"


@torch.no_grad()
def update_scales(states: list[ScalingState], step_amax: torch.Tensor) -> None:
    """Roll each history with this step's (already reduced) amax and recompute the scales, batched."""
    if not states:
        return
    # A NaN/inf amax carries no usable magnitude: record 0 ("no information") so it cannot pin the
    # history's max for amax_history_len steps; the scale then stays as it was.
    step_amax = torch.where(torch.isfinite(step_amax), step_amax, torch.zeros_like(step_amax))
    by_length: dict[int, list[int]] = {}
    for i, state in enumerate(states):
        by_length.setdefault(state.amax_history.numel(), []).append(i)
    for indices in by_length.values():
        group = [states[i] for i in indices]
        history = torch.stack([s.amax_history for s in group]).roll(1, dims=1)
        history[:, 0] = step_amax[indices]
        most_recent = torch.tensor([s.recipe.amax_compute_algo == "most_recent" for s in group], device=history.device)
        amax = torch.where(most_recent, history[:, 0], history.amax(dim=1))
        fp8_max = torch.tensor([s.fp8_max for s in group], device=history.device)
        margin = torch.tensor([float(2 ** s.recipe.margin) for s in group], device=history.device)
        new_scale = fp8_max / amax / margin
        pow2 = torch.tensor([s.recipe.power_of_2_scale for s in group], device=history.device)
        rounded_down = (new_scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # clear the mantissa
        new_scale = torch.where(pow2, rounded_down, new_scale)
        old_scale = torch.stack([s.scale for s in group])
        new_scale = torch.where((amax > 0) & torch.isfinite(new_scale), new_scale, old_scale)
        for j, state in enumerate(group):
            state.amax_history.copy_(history[j])
            state.scale.copy_(new_scale[j])
            state.pending_amax.zero_()


class Fp8ScalingManager:
    """Owns the once-per-step delayed-scaling update of a whole model.

    reduce_group:  the TP x DP ("amax") process group, or None for a single process.
    all_reduce_max: optional callable(tensor, group) doing an in-place MAX all-reduce; the parallel
                   layer passes its byte-counting collective here. Defaults to torch.distributed.
    """

    def __init__(self, model: nn.Module, reduce_group=None,
                 all_reduce_max: Callable[[torch.Tensor, object], None] | None = None):
        self.model = model
        self.reduce_group = reduce_group
        self.all_reduce_max = all_reduce_max or _dist_all_reduce_max
        self.updates = 0

    def states(self) -> list[ScalingState]:
        return [m for m in self.model.modules() if isinstance(m, ScalingState)]

    @torch.no_grad()
    def update(self) -> None:
        """Call once per optimizer step, after backward: one collective for every layer's amaxes."""
        from .linear import invalidate_fp8_weight_caches  # new scales invalidate cached FP8 weights

        states = self.states()
        if states:
            step_amax = torch.stack([s.pending_amax for s in states])
            if self.reduce_group is not None or (dist.is_available() and dist.is_initialized()):
                self.all_reduce_max(step_amax, self.reduce_group)
            update_scales(states, step_amax)
        invalidate_fp8_weight_caches(self.model)
        self.updates += 1


def _dist_all_reduce_max(tensor: torch.Tensor, group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
