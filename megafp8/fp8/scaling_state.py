"""Delayed-scaling state: per-role amax histories and scales, updated once per step with ONE all-reduce and a
fixed handful of device ops, whatever the layer count.

Each FP8 tensor role of each layer (input, weight, grad_output) owns a ScalingState: its scale is used
for every micro-batch of the step, and the amaxes those micro-batches observe are folded into
`pending_amax`. At the end of the step Fp8ScalingManager.update() max-reduces every pending amax of the
model over the amax group (TP x DP of one pipeline stage) in a single collective, so all ranks end with
identical scales, then rolls the histories and computes the new scales by TransformerEngine's rule
(its fused `amax_and_scale_update_after_reduction` kernel):

    a step amax of 0 (the tensor was not seen this step) leaves the history as it is
    amax  = max(history)  or  the step's amax (most_recent)
    scale = (FP8_MAX * 2**-margin) / amax     kept when amax is 0; fp32 max when the quotient overflows
    power_of_2_scale rounds the new scale down to a power of two

One deliberate difference: an inf/NaN step amax is recorded as 0 (TE records it), so a single bad step
cannot pin a `max` history, and hence the scale, for amax_history_len steps.

Flat storage. The manager keeps the histories, scales and pending amaxes of all states in three flat
fp32 tensors (one row per state; histories zero-padded to the longest) and points each state's buffers
at views of them. The views are ordinary buffers: state_dict() and checkpoints see
`...fp8_scaling.<role>.amax_history` / `.scale` exactly as before, and load_state_dict() copies into
them in place, so the views stay valid. Whatever may replace a state's tensors (a new state, `.to()` or a
cast, a load with `assign=True`) bumps a class-wide layout version, and a manager adopting states marks
their previous manager's buffers stale; a manager checks one integer and one flag per update and, when
either says so, rebuilds its flat tensors from the states' current values before updating.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megafp8_kernels import fp8_format

from .recipe import Fp8Recipe

_FP32_MAX = torch.finfo(torch.float32).max
_PERSISTENT = ("amax_history", "scale")
FRESH_STATE_WARNING = (
    "the loaded state dict has no FP8 delayed-scaling state for some layers (no fp8_scaling.* entries, e.g. an "
    "HF checkpoint): their amax histories and scales start fresh (cold) and fill in over the next steps")


class UpdateClock:
    """Host-side count of the update() calls of the manager a state belongs to (is_cold needs no sync)."""

    def __init__(self) -> None:
        self.updates = 0


class ScalingState(nn.Module):
    """Amax history (index 0 = most recent) and current quantization scale of one FP8 tensor role."""

    # Class-wide on purpose: a manager must notice a replaced tensor in any state of its model without
    # walking the model every step (see the module docstring).
    layout_version = 0

    def __init__(self, recipe: Fp8Recipe, fp8_dtype: torch.dtype):
        super().__init__()
        self.recipe = recipe
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_format(fp8_dtype).max
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len))
        self.register_buffer("scale", torch.ones(()))  # TransformerEngine starts from 1 too
        self.register_buffer("pending_amax", torch.zeros(()), persistent=False)
        self._warm = False
        self._observed_at: int | None = None  # clock value of the first observe() while cold
        self._scale_writes = 0  # resets and loads: the scale changes outside update()
        self._clock = UpdateClock()
        self._owner: weakref.ref[FlatScalingBuffers] | None = None  # the flat buffers this state views
        _bump_layout_version()

    @property
    def is_cold(self) -> bool:
        """True until an update() has folded an amax this state observed into its history; host-side, no
        device sync. (A step whose reduced amax was 0 or non-finite still counts: the host cannot see the
        value.) A loaded state is cold when its loaded history is all zero."""
        if not self._warm and self._observed_at is not None and self._clock.updates > self._observed_at:
            self._warm = True
        return not self._warm

    @property
    def scale_version(self) -> tuple:
        """Changes whenever the scale (or is_cold) may have changed: at every update() of its manager, a load,
        a reset. Host-side, so an FP8 weight cached under this scale can check it without a device sync
        (update() cannot tell the host which scales actually moved)."""
        return self._clock, self._clock.updates, self._scale_writes

    @torch.no_grad()
    def observe(self, amax: torch.Tensor) -> None:
        """Fold one micro-batch's amax into this step's (no host sync: stays a device tensor)."""
        torch.maximum(self.pending_amax, amax.reshape(()).to(self.pending_amax), out=self.pending_amax)
        # Only a cold state needs the clock (is_cold); a warm one writes no host attribute, so a forward compiled
        # by torch.compile can observe inside its graph (dynamo refuses a host write inside an autograd.Function).
        if not self._warm and self._observed_at is None:
            self._observed_at = self._clock.updates

    @torch.no_grad()
    def reset(self) -> None:
        """Back to a fresh state: empty history, scale 1, cold."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.pending_amax.zero_()
        self._warm, self._observed_at = False, None
        self._scale_writes += 1

    def bind(self, owner: FlatScalingBuffers, amax_history: torch.Tensor, scale: torch.Tensor,
             pending_amax: torch.Tensor, clock: UpdateClock) -> None:
        """Use these tensors (views into `owner`'s flat buffers, holding this state's values) from now on."""
        previous = self._owner() if self._owner is not None else None
        if previous is not None and previous is not owner:
            previous.stale = True  # its manager must not update tensors this state no longer uses
        self._owner = weakref.ref(owner)
        warm = not self.is_cold
        pending_observation = not warm and self._observed_at is not None
        self._buffers["amax_history"], self._buffers["scale"] = amax_history, scale
        self._buffers["pending_amax"] = pending_amax
        self._clock, self._warm = clock, warm
        self._observed_at = clock.updates if pending_observation else None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_owner"] = None  # a copy or unpickled model is nobody's until a manager binds it
        return state

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() must not round histories and scales: keep the fp32 values on any device.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = before[name].to(device=buf.device)
        _bump_layout_version()  # the flat views may have been replaced by per-state tensors
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not any(prefix + name in state_dict for name in _PERSISTENT):
            # A checkpoint without scaling state (HF weights, a model saved before the layer met a delayed
            # recipe): not an error, the state starts fresh. Python shows the warning once per process.
            self.reset()
            warnings.warn(FRESH_STATE_WARNING, stacklevel=2)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        _bump_layout_version()  # assign=True replaces the tensors
        self.history_loaded()

    def history_loaded(self) -> None:
        """The history was written from outside (a state dict, or a checkpoint loaded in place): the state
        is warm iff it holds an amax, and amaxes observed before the load (e.g. of the freshly initialized
        weights) belong to another history. One host sync per state, at load time only."""
        self.pending_amax.zero_()
        self._warm = bool(self.amax_history.any())
        self._observed_at = None
        self._scale_writes += 1

    def extra_repr(self) -> str:
        return f"history={self.recipe.amax_history_len}, algo={self.recipe.amax_compute_algo}, margin={self.recipe.margin}"


def _bump_layout_version() -> None:
    ScalingState.layout_version += 1


class FlatScalingBuffers:
    """The states of one model in flat tensors (states hold views of their rows), with the per-state
    constants of the update rule built once."""

    def __init__(self, states: list[ScalingState], clock: UpdateClock):
        devices = {s.scale.device for s in states}
        if len(devices) > 1:
            raise ValueError(f"the model's FP8 scaling states are on several devices ({', '.join(map(str, devices))}):"
                             " Fp8ScalingManager needs them on one device (one pipeline stage per process)")
        device = devices.pop()
        lengths = [s.amax_history.numel() for s in states]
        self.states = states
        self.stale = False
        self.history = torch.zeros(len(states), max(lengths), device=device)
        for row, (state, length) in enumerate(zip(states, lengths)):  # at (re)build only, not per step
            self.history[row, :length].copy_(state.amax_history)
        self.scale = torch.stack([s.scale.float() for s in states])
        self.pending = torch.stack([s.pending_amax.float() for s in states])

        def per_state(values, dtype=torch.bool):
            return torch.tensor(values, dtype=dtype, device=device)

        self.scaled_max = per_state([s.fp8_max * 2.0 ** -s.recipe.margin for s in states], torch.float32)
        most_recent = [s.recipe.amax_compute_algo == "most_recent" for s in states]
        pow2 = [s.recipe.power_of_2_scale for s in states]
        # Masks only where the states differ; uniform recipes (the usual case) skip the select entirely.
        self.all_most_recent = all(most_recent)
        self.most_recent = per_state(most_recent) if any(most_recent) and not all(most_recent) else None
        self.all_pow2 = all(pow2)
        self.pow2 = per_state(pow2) if any(pow2) and not all(pow2) else None
        self.any_pow2 = any(pow2)
        ragged = len(set(lengths)) > 1
        self.in_history = (torch.arange(max(lengths), device=device) < per_state(lengths, torch.int64).unsqueeze(1)
                           if ragged else None)  # zero-padding of shorter histories stays zero
        for row, (state, length) in enumerate(zip(states, lengths)):
            state.bind(self, self.history[row, :length], self.scale[row], self.pending[row], clock)

    @torch.no_grad()
    def update(self) -> None:
        """Roll the histories with the (already reduced) pending amaxes and recompute every scale."""
        step = self.pending
        recorded = torch.nan_to_num(step, nan=0.0, posinf=0.0, neginf=0.0)
        seen = step != 0  # NaN counts as seen (TE rolls it too); only a true 0 leaves the history alone
        rolled = torch.cat([recorded.unsqueeze(1), self.history[:, :-1]], dim=1)
        if self.in_history is not None:
            rolled = torch.where(self.in_history, rolled, 0.0)
        torch.where(seen.unsqueeze(1), rolled, self.history, out=self.history)
        if self.all_most_recent:
            amax = recorded
        else:
            amax = self.history.amax(dim=1)
            if self.most_recent is not None:
                amax = torch.where(self.most_recent, recorded, amax)
        new_scale = (self.scaled_max / amax).clamp_(max=_FP32_MAX)
        if self.any_pow2:
            rounded_down = (new_scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # clear the mantissa
            new_scale = rounded_down if self.all_pow2 else torch.where(self.pow2, rounded_down, new_scale)
        torch.where(amax > 0, new_scale, self.scale, out=self.scale)
        self.pending.zero_()


@dataclass
class ScalingSnapshot:
    """Fp8ScalingManager.snapshot(): three flat copies whatever the layer count, and the host-side marks."""

    states: list[ScalingState]  # in the flat buffers' row order
    history: torch.Tensor
    scale: torch.Tensor
    pending: torch.Tensor
    updates: int  # the update clock
    marks: list[tuple[bool, int | None, int]]  # per state: warm, first observe while cold, scale writes


class Fp8ScalingManager:
    """Owns the once-per-step delayed-scaling update of a whole model (or pipeline stage).

    amax_group:     the process group the amaxes are max-reduced over: the TP x DP group of this pipeline
                    stage (megafp8.parallel.fp8_sequence_parallel.fp8_scaling_manager passes it). Required;
                    None only when the run is a single process.
    expert_group:   the group the amaxes of expert-parallel experts' states (below a module the MoE layer marks
                    ``expert_parallel``) are max-reduced over instead: the ranks holding the same experts (ETP x EDP). Their
                    states sit after the others in the flat buffers, so each group reduces one contiguous slice.
    all_reduce_max: optional callable(tensor, group) doing an in-place MAX all-reduce; the parallel
                    layer passes its byte-counting collective here. Defaults to torch.distributed.

    update() touches no cached FP8 weight: each cache entry is keyed on its weight state's scale_version,
    which every update() moves, so the first forward after it re-quantizes (and re-observes) the weight
    under the new scale, exactly as a module freshly loaded from the state dict would. A weight the
    optimizer injected (set_fp8_weight) cannot be re-quantized by the layer: the optimizer re-publishes it.
    """

    def __init__(self, model: nn.Module, amax_group,
                 all_reduce_max: Callable[[torch.Tensor, object], None] | None = None, expert_group=None):
        self.model = model
        self.amax_group, self.expert_group = amax_group, expert_group
        self._num_expert_states = 0
        self.all_reduce_max = all_reduce_max or _dist_all_reduce_max
        self._clock = UpdateClock()
        self._flat: FlatScalingBuffers | None = None
        self._built_for_layout = -1
        self._require_group()

    @property
    def updates(self) -> int:
        return self._clock.updates

    def states(self) -> list[ScalingState]:
        flat = self._flat_buffers()
        return [] if flat is None else list(flat.states)

    def _flat_buffers(self) -> FlatScalingBuffers | None:
        stale = self._flat is not None and self._flat.stale
        if stale or self._built_for_layout != ScalingState.layout_version:  # O(1) on the hot path
            states = [m for m in self.model.modules() if isinstance(m, ScalingState)]
            # A state belongs to an expert when a module above it is marked (its states are made later, with a recipe).
            in_experts = {id(s) for m in self.model.modules() if getattr(m, "expert_parallel", False)
                          for s in m.modules() if isinstance(s, ScalingState)}
            experts = [s for s in states if id(s) in in_experts]
            states = [s for s in states if id(s) not in in_experts] + experts
            self._num_expert_states = len(experts)
            self._flat = FlatScalingBuffers(states, self._clock) if states else None
            self._built_for_layout = ScalingState.layout_version
        return self._flat

    def snapshot(self, to_host: Callable[[torch.Tensor], torch.Tensor]) -> ScalingSnapshot | None:
        """Everything update() and the layers' observe() change: the flat histories, scales and pending amaxes
        (copied by `to_host`), the update clock and each state's cold/warm marks and scale-write count (the scale
        version FP8 weights are cached and injected under). None without FP8 delayed-scaling states."""
        flat = self._flat_buffers()
        if flat is None:
            return None
        return ScalingSnapshot(list(flat.states), to_host(flat.history), to_host(flat.scale), to_host(flat.pending),
                               self._clock.updates, [(s._warm, s._observed_at, s._scale_writes) for s in flat.states])

    def restore(self, snapshot: ScalingSnapshot, copy_back: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Back to `snapshot` (the same states: a layer added or removed since is refused)."""
        flat = self._flat_buffers()
        if flat is None or flat.states != snapshot.states:
            raise RuntimeError("restoring FP8 scaling state: the model's scaling states changed since the snapshot")
        for target, host in ((flat.history, snapshot.history), (flat.scale, snapshot.scale),
                             (flat.pending, snapshot.pending)):
            copy_back(target, host)
        self._clock.updates = snapshot.updates
        for state, (warm, observed_at, scale_writes) in zip(flat.states, snapshot.marks):
            state._warm, state._observed_at, state._scale_writes = warm, observed_at, scale_writes

    def _require_group(self) -> None:
        if self.amax_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"Fp8ScalingManager(model, amax_group=None) in a run of {dist.get_world_size()} processes: pass the "
                "amax group (the TP x DP group of this pipeline stage, ParallelState.amax_group; or build the "
                "manager with megafp8.parallel.fp8_sequence_parallel.fp8_scaling_manager). None is for a "
                "single process only: reducing over WORLD would mix pipeline stages")

    @torch.no_grad()
    def update(self) -> None:
        """Call once per optimizer step, after backward: one collective for every layer's amaxes."""
        flat = self._flat_buffers()
        if flat is not None:
            if self.amax_group is None:
                self._require_group()
            elif self._num_expert_states == 0:
                self.all_reduce_max(flat.pending, self.amax_group)
            else:  # the dense states over the stage, the experts' over their holders: two contiguous slices
                dense = len(flat.states) - self._num_expert_states
                if dense:
                    self.all_reduce_max(flat.pending[:dense], self.amax_group)
                self.all_reduce_max(flat.pending[dense:], self.expert_group)
            flat.update()
        self._clock.updates += 1


def _dist_all_reduce_max(tensor: torch.Tensor, group) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
