"""FP8 telemetry: per tensor amax, scale, fraction saturated and fraction flushed to zero; and a guard
that moves a persistently saturating layer to high precision.

Off by default; the training loop turns it on when it logs telemetry (every --log-interval) and, for the
guard, every step. It costs no pass over the tensor: the quantizer counts saturated and flushed elements in
the cast itself (quantize(stats=True): two atomics per tile on GPU), and record_fp8_stats only keeps the
quantizer's own device tensors (0 ops). Values stay on the device until collect_fp8_telemetry() reads
them, once per logged iteration; the guard keeps its strikes on the device too (see SaturationGuard).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from megafp8_kernels import fp8_format


def saturation_threshold(fp8_dtype: torch.dtype) -> float:
    """The scaled magnitude above which a value is clipped rather than rounded: FP8_MAX plus half an ulp
    at FP8_MAX (E4M3: 464, E5M2: 61440). Anything below rounds to a representable value honestly."""
    return fp8_format(fp8_dtype).saturation_threshold


class Fp8TensorStats(NamedTuple):
    """One quantization's telemetry as the quantizer returned it; the statistics are derived when read.

    counts: int64 [saturated, flushed] of the row-major cast (Fp8Quantized.counts): saturated = |x| * scale
    past saturation_threshold (a group's own amax maps to FP8_MAX and is not clipped), flushed = nonzero x
    that became +-0. A compiled layer's slots (add_fp8_telemetry_slots) hold the amax's max, the scale_inv's min
    and the numel as device tensors of fixed shapes."""

    amax: torch.Tensor  # per scaling group
    scale_inv: torch.Tensor  # per scaling group
    counts: torch.Tensor
    numel: int | torch.Tensor

    def values(self) -> dict[str, torch.Tensor]:
        fractions = self.counts / self.numel  # float32, as the guard's
        return {
            "amax": self.amax.float().max(),
            "scale": 1.0 / self.scale_inv.float().min(),  # the largest scale of any group: tensorwise = the scale
            "saturated": fractions[0],
            "flushed_to_zero": fractions[1],
        }


def record_fp8_stats(layer: nn.Module, role: str, fp8, counts: torch.Tensor, amax: torch.Tensor) -> None:
    """Keep this quantization's statistics on `layer` under `role` (input, weight, grad_output): the tensors
    the quantizer returned with stats=True, no op of its own."""
    # Microscaled scales are bytes (E8M0 exponents, E4M3 under a tensor scale): telemetry reads their fp32 values.
    scale_inv = fp8.block_scales_fp32() if fp8.is_microscaled else fp8.row_major()[1]
    slot = getattr(layer, "fp8_telemetry_slots", {}).get(role)
    if slot is not None:
        # A compiled layer (megafp8.model.compile): a graph cannot hand its intermediates to the host, so it
        # writes the statistics, reduced to fixed shapes, into the slots the layer owns (fused by inductor).
        slot.amax.copy_(amax.float().amax())
        slot.scale_inv.copy_(scale_inv.float().amin())
        slot.counts.copy_(counts)
        slot.numel.fill_(fp8.logical_numel)
        return
    # Elements of the logical tensor, not of the payload (a packed 4-bit payload holds two per byte).
    layer.fp8_telemetry[role] = Fp8TensorStats(amax, scale_inv, counts, fp8.logical_numel)


def add_fp8_telemetry_slots(layer: nn.Module, roles: tuple[str, ...], device: torch.device) -> None:
    """Give `layer` statistics it owns for `roles`, written in place by record_fp8_stats from now on: what a
    torch.compile'd layer needs (its graph cannot store references). Call it (eagerly) right before the layer
    records them: a slot reads NaN saturation until its first write."""
    slots = layer.__dict__.setdefault("fp8_telemetry_slots", {})
    for role in roles:
        if role not in slots:
            slots[role] = Fp8TensorStats(torch.zeros((), device=device), torch.ones((), device=device),
                                         torch.zeros(2, dtype=torch.int64, device=device),
                                         torch.zeros((), dtype=torch.int64, device=device))
        if layer.fp8_telemetry.get(role) is not slots[role]:
            layer.fp8_telemetry[role] = slots[role]


def enable_fp8_telemetry(model: nn.Module, enabled: bool = True) -> None:
    for module in model.modules():
        if hasattr(module, "fp8_telemetry"):
            module.telemetry_enabled = enabled


def collect_fp8_telemetry(model: nn.Module) -> dict[str, float]:
    """Flat {"fp8/<layer>/<role>/<stat>": value} of the latest recorded statistics (one host sync)."""
    keys, values = [], []
    for name, module in model.named_modules():
        for role, stats in getattr(module, "fp8_telemetry", {}).items():
            for stat, value in stats.values().items():
                keys.append(f"fp8/{name}/{role}/{stat}")
                values.append(value.reshape(()))
    if not values:
        return {}
    return dict(zip(keys, torch.stack(values).tolist()))


def collect_block_scale_histograms(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"fp8/<layer>/<role>/log2_block_scale": log2 of every finite, positive block scale (CPU tensor)} of the layers
    that ran a microscaled recipe (MXFP8, NVFP4, MXFP4: one scale per 16 or 32 elements) in their latest recorded
    quantization: the distribution users ask TransformerEngine for when a block format misbehaves (scales piling up
    at the format's floor flush blocks; a wide spread is what the per-tensor NVFP4 scale has to cover). One device to
    host copy per tensor: for log iterations under --log-fp8-telemetry only."""
    histograms = {}
    for name, module in model.named_modules():
        recipe = getattr(module, "recipe", None)
        if recipe is None or not getattr(recipe, "is_microscaled", False):
            continue
        for role, stats in getattr(module, "fp8_telemetry", {}).items():
            scales = stats.scale_inv.detach().float().flatten()
            scales = scales[torch.isfinite(scales) & (scales > 0)]
            if scales.numel():
                histograms[f"fp8/{name}/{role}/log2_block_scale"] = torch.log2(scales).cpu()
    return histograms


class _LaggedFlags:
    """A ring of lag + 1 host bools: push() copies a device flag into the next one without blocking, pop_lagged()
    returns the flag pushed `lag` pushes ago (False until there is one), after its copy's CUDA event."""

    def __init__(self, lag: int, device: torch.device):
        cuda = device.type == "cuda"
        self.lag, self.count = lag, 0
        # A meta device (a shapes-only run: tools/bench/bench_host_overhead.py) has no flag value to copy out:
        # its ring stays on meta (the same copy op per push) and never reads as tripped.
        host = "meta" if device.type == "meta" else None
        self.host = [torch.zeros((), dtype=torch.bool, pin_memory=cuda, device=host)
                     for _ in range(lag + 1 if lag else 0)]
        self.events = [torch.cuda.Event() if cuda else None for _ in self.host]

    def push(self, flag: torch.Tensor) -> None:
        slot = self.count % len(self.host)
        self.host[slot].copy_(flag, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.count += 1

    def pop_lagged(self) -> bool:
        if self.count <= self.lag:
            return False
        slot = (self.count - 1 - self.lag) % len(self.host)
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # `lag` iterations old: done unless the CPU ran that far ahead
        if self.host[slot].is_meta:
            return False
        # A plain read of host memory (no torch op, so nothing that could wait for the device).
        return ctypes.c_bool.from_address(self.host[slot].data_ptr()).value


class SaturationGuard:
    """Switch a layer to high precision when its saturated fraction stays above `threshold` for `patience`
    consecutive checks. check() returns one message per switch, for the console; `events` collects the
    same switches as records ({"iteration", "layer", "saturated"}) until take_events() drains them for
    metrics.jsonl. A switched layer's telemetry is dropped: it quantizes nothing any more.

    No host read per step: check() runs every step on the device (the layers' saturated counts, the MAX
    all-reduce, strikes += 1 or reset, and the iteration and fraction at which a layer first reached
    `patience`: the same strikes, hence the same decisions, as a check that read every step). The host reads
    them every `read_interval` iterations (the trainer passes --log-interval, when it reads its own
    counters) and in state_dict() and take_events(): a layer that tripped in between is switched then, and its event
    names the iteration it tripped at. read_interval=1 switches at the very check that trips, as before.
    With `switch_lag` = L >= 1 a trip also lands L checks later without waiting for a read iteration: each check
    copies one "a layer tripped" flag to (pinned) host memory without blocking, and the check L later reads that
    flag (after the copy's CUDA event, L iterations old: the CPU runs at most L iterations ahead of the GPU, the
    queue is never drained); only when it is set does that check read the strikes and switch (one host read in
    the iteration a layer switches). Every rank reads the flag of the same check, so all switch at the same
    iteration. The trainer uses L = 1: a forced overflow clipped the layer for 8 more steps at --log-interval 10
    before (docs/parity), for 1 now.

    all_reduce_max: in-place MAX over the ranks that share the layers (the TP x DP group). Every rank must
    take the same decision, or ranks would disagree on the precision (and the collectives) of a layer.
    expert_all_reduce_max: the same over the ranks holding the same experts, for the layers of expert-parallel
    experts (marked ``expert_parallel`` by the MoE layer; checked after the others): each expert's holders agree,
    ranks holding other experts decide on theirs.
    state_dict() / load_state_dict(state, model) carry the strikes and the switched layers, so a resumed
    run keeps its switches (the model's own state dict stays free of it, and so HF-convertible).
    With a `kurtosis_warning` (--fp8-saturation-guard-kurtosis) the trainer also passes each logged iteration's
    kurtosis alarms to switch_early(), which switches those layers at once (FOG's early warning acted on); that
    warning's windows then travel in state_dict() too.
    """

    # Default threshold 1%: delayed scaling clips ~0.2% of an MLP's FC2 input for a few steps while activations
    # grow during LR warm-up (measured in the 500-step parity run, docs/parity), a transient that should not
    # cost a layer its FP8 for the rest of the run; persistent saturation above 1% is a real problem.
    def __init__(self, threshold: float = 1e-2, patience: int = 3,
                 all_reduce_max: Callable[[torch.Tensor], None] | None = None, read_interval: int = 1,
                 switch_lag: int = 0, expert_all_reduce_max: Callable[[torch.Tensor], None] | None = None):
        if not 0 <= threshold < 1 or patience < 1 or read_interval < 1 or switch_lag < 0:
            raise ValueError("saturation guard needs 0 <= threshold < 1, patience >= 1, read_interval >= 1 and "
                             f"switch_lag >= 0, got {threshold}, {patience}, {read_interval}, {switch_lag}")
        self.threshold, self.patience, self.read_interval, self.switch_lag = threshold, patience, read_interval, switch_lag
        self.all_reduce_max, self.expert_all_reduce_max = all_reduce_max, expert_all_reduce_max
        self.strikes: dict[str, int] = {}
        self.switched: set[str] = set()
        self.demotions: dict[str, int] = {}  # steps down its ladder per switched layer (FP4 -> FP8 -> BF16: up to 2)
        self.events: list[dict] = []
        self._messages: list[str] = []
        self.kurtosis_warning = None  # a megafp8.fp8.kurtosis.KurtosisWarning whose alarms switch_early() acts on
        # Device state of the layers checked since the last read (_start): their (name, module), each stat's
        # layer index and numel, and per layer strikes / tripped / the iteration and fraction it tripped at.
        self._start([], [])

    def snapshot(self) -> dict:
        """The guard between two checks, for a step re-run: host strikes and switches, its device tensors (replaced,
        never written into, at each check: holding them is a snapshot) and its lagged-flag ring's count. Reads no
        device value."""
        return {"strikes": dict(self.strikes), "switched": set(self.switched), "demotions": dict(self.demotions),
                "events": list(self.events),
                "_messages": list(self._messages), "_layers": self._layers, "_structure": self._structure,
                "_numels": self._numels, "_unread": self._unread, "_device": dict(self._device),
                "_flags": self._flags, "flag_count": self._flags.count}

    def restore(self, snapshot: dict) -> None:
        """Back to `snapshot`; refused once a layer was switched to high precision since (that is not undone)."""
        if self.switched != snapshot["switched"] or self.demotions != snapshot["demotions"]:
            raise RuntimeError("the saturation guard switched layers to high precision since the snapshot "
                               f"({sorted(self.switched - snapshot['switched'])}); a re-run must go back before the "
                               "optimizer step's guard check")
        for name, value in snapshot.items():
            if name != "flag_count":
                setattr(self, name, type(value)(value) if isinstance(value, (dict, set, list)) else value)
        self._flags.count = snapshot["flag_count"]

    def check(self, model: nn.Module, iteration: int | None = None) -> list[str]:
        layers, stats = self._checked(model)
        if ([n for n, _ in layers], [i for i, _ in stats]) != self._structure:
            self._read()  # the checked layers changed (the first check, a switch): settle what the device holds
            layers, stats = self._checked(model)  # without any layer that read switched
            self._start(layers, stats)
        if stats:
            numels = [s.numel for _, s in stats]
            device = stats[0][1].counts.device
            if any(isinstance(n, torch.Tensor) for n in numels):  # a compiled layer's slots: counted on the device
                self._numels = None
                self._device["numels"] = torch.stack([torch.as_tensor(n, device=device) for n in numels])
            elif numels != self._numels:  # another batch shape: a host->device copy, no read
                self._numels = numels
                self._device["numels"] = torch.tensor(numels, device=device)
            self._strike(torch.stack([s.counts for _, s in stats]), -1 if iteration is None else iteration)
            if self.switch_lag:
                self._flags.push(self._device["tripped"].any())
        if iteration is None or iteration % self.read_interval == 0:
            self._read(iteration)
        elif self.switch_lag and self._flags.pop_lagged():
            self._read(iteration)
        messages, self._messages = self._messages, []
        return messages

    @staticmethod
    def _checked(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[int, Fp8TensorStats]]]:
        """The layers still in FP8 with statistics, and (layer index, stats) of each of their tensors."""
        layers = [(name, module) for name, module in model.named_modules()
                  if getattr(module, "fp8_telemetry", None) and not module.runs_high_precision]
        # Expert-parallel experts last: their saturation reduces over their holders (expert_all_reduce_max).
        layers = ([(n, m) for n, m in layers if not getattr(m, "expert_parallel", False)]
                  + [(n, m) for n, m in layers if getattr(m, "expert_parallel", False)])
        return layers, [(i, s) for i, (_, module) in enumerate(layers) for s in module.fp8_telemetry.values()]

    def _start(self, layers: list[tuple[str, nn.Module]], stats: list) -> None:
        self._layers, self._device, self._numels, self._unread = layers, {}, None, False
        self._num_expert_layers = sum(bool(getattr(m, "expert_parallel", False)) for _, m in layers)
        self._structure = ([n for n, _ in layers], [i for i, _ in stats])
        device = stats[0][1].counts.device if stats else torch.device("cpu")
        self._flags = _LaggedFlags(self.switch_lag, device)  # pending flags belong to the previous layer set
        if not stats:
            return
        names = [name for name, _ in layers]
        # Host->device copies once per change of the checked layers, not per step.
        self._device = dict(
            layer_of_stat=torch.tensor([i for i, _ in stats], device=device),
            strikes=torch.tensor([self.strikes.get(n, 0) for n in names], device=device),
            tripped=torch.zeros(len(names), dtype=torch.bool, device=device),
            tripped_at=torch.zeros(len(names), dtype=torch.int64, device=device),
            tripped_saturated=torch.zeros(len(names), dtype=torch.float32, device=device))

    def _strike(self, counts: torch.Tensor, iteration: int) -> None:
        """One check on the device: a constant number of ops whatever the number of layers."""
        d = self._device
        fractions = counts[:, 0] / d["numels"]  # float32, as telemetry reports it
        worst = fractions.new_zeros(len(self._layers)).scatter_reduce_(0, d["layer_of_stat"], fractions, "amax")
        if self.all_reduce_max is not None and self._num_expert_layers:  # dense over the stage, experts over holders
            dense = len(self._layers) - self._num_expert_layers
            if dense:
                self.all_reduce_max(worst[:dense])
            self.expert_all_reduce_max(worst[dense:])
        elif self.all_reduce_max is not None:
            self.all_reduce_max(worst)
        # Compared in fp64 with the threshold, as the float32 fraction read to a Python float was.
        strikes = torch.where(worst.double() > self.threshold, d["strikes"] + 1, 0)
        d["strikes"] = torch.where(d["tripped"], d["strikes"], strikes)  # a tripped layer's strikes stay put
        newly = ~d["tripped"] & (d["strikes"] >= self.patience)
        d["tripped_at"] = torch.where(newly, iteration, d["tripped_at"])
        d["tripped_saturated"] = torch.where(newly, worst, d["tripped_saturated"])
        d["tripped"] = d["tripped"] | newly
        self._unread = True

    def _read(self, iteration: int | None = None) -> None:
        """The one host read: fold the device strikes into `strikes` and switch the layers that tripped."""
        if not self._device or not self._unread:
            return
        self._unread = False
        d = self._device
        packed = torch.stack([d["strikes"].double(), d["tripped"].double(), d["tripped_at"].double(),
                              d["tripped_saturated"].double()]).tolist()
        switched = False
        for (name, module), strikes, tripped, tripped_at, fraction in zip(self._layers, *packed):
            self.strikes[name] = int(strikes)
            if not tripped:
                continue
            to = self._step_down(name, module)
            if not module.runs_high_precision:
                self.strikes[name] = 0  # moved to FP8 (from FP4): checked afresh in its new format
            switched = True
            at = int(tripped_at)
            self.events.append({"iteration": at if at >= 0 else iteration, "layer": name, "saturated": fraction})
            when = f" at iteration {at}" if at >= 0 else ""
            later = f" (applied at iteration {iteration})" if iteration is not None and 0 <= at < iteration else ""
            self._messages.append(f"fp8 guard: {name or 'model'} saturated {fraction:.2%} > {self.threshold:.2%} for "
                                  f"{self.patience} checks{when}: switched to {to}{later}")
        if switched:  # the next check starts afresh from the host strikes, without the switched layers
            self._start([], [])

    def _step_down(self, name: str, module: nn.Module) -> str:
        """Move ``module`` one step down its ladder and record the switch; returns where it went, for the message."""
        _demote(module)
        module.fp8_telemetry.clear()
        self.switched.add(name)
        self.demotions[name] = self.demotions.get(name, 0) + 1
        return "high precision" if module.runs_high_precision else f"{module.recipe.scaling} {module.recipe.fp8_format}"

    def switch_early(self, model: nn.Module, alarms, iteration: int) -> list[str]:
        """Switch the layers of ``alarms`` (KurtosisAlarm: a layer's input kurtosis grew past --kurtosis-warning-ratio
        x its recent low) one step down their ladder now, before any saturation: each is an event
        ``{"iteration", "layer", "saturated": None, "kurtosis"}`` and a message, as a trip is. Every rank of the
        stage must pass the same alarms (the trainer sums the moments over the stage's TP x CP x DP ranks first),
        so all switch together. Returns the messages (a trip settled by the read before it included)."""
        modules = dict(model.named_modules())
        alarms = [a for a in alarms if a.layer in modules and not modules[a.layer].runs_high_precision]
        if alarms:
            self._read(iteration)  # settle the device strikes first: a pending trip switches now, with its own event
            for alarm in alarms:
                module = modules[alarm.layer]
                if module.runs_high_precision:  # that read just switched it
                    continue
                to = self._step_down(alarm.layer, module)
                self.strikes[alarm.layer] = 0
                self.events.append({"iteration": iteration, "layer": alarm.layer, "saturated": None,
                                    "kurtosis": alarm.kurtosis})
                self._messages.append(
                    f"fp8 guard: {alarm.layer} input kurtosis {alarm.kurtosis:.1f} reached "
                    f"{alarm.kurtosis / alarm.low:.1f}x its recent low ({alarm.low:.1f}) at iteration {iteration}: "
                    f"switched to {to} (--fp8-saturation-guard-kurtosis)")
            self._start([], [])  # the next check starts afresh without the switched layers
        messages, self._messages = self._messages, []
        return messages

    def take_events(self) -> list[dict]:
        self._read()  # so a trip after the last read iteration (the run's end) is not lost
        events, self.events = self.events, []
        return events

    def state_dict(self) -> dict:
        self._read()  # a checkpoint is a read point: a layer that tripped since the last read switches now
        # (no read at all when nothing was checked since the last one, e.g. a save on a log iteration)
        state = {"strikes": dict(self.strikes), "switched": sorted(self.switched), "demotions": dict(self.demotions)}
        if self.kurtosis_warning is not None:
            state["kurtosis_warning"] = self.kurtosis_warning.state_dict()
        return state

    def load_state_dict(self, state: dict, model: nn.Module) -> None:
        self._start([], [])
        self.strikes = dict(state.get("strikes", {}))
        if self.kurtosis_warning is not None and "kurtosis_warning" in state:  # (a run without it starts them afresh)
            self.kurtosis_warning.load_state_dict(state["kurtosis_warning"])
        modules = dict(model.named_modules())
        for name in state.get("switched", []):
            if name not in modules:
                raise KeyError(f"saturation guard state names layer {name!r}, which this model does not have")
            steps = state.get("demotions", {}).get(name, 1)  # a checkpoint from before the ladder: one step
            for _ in range(steps):
                _demote(modules[name])
            modules[name].fp8_telemetry.clear()
            self.switched.add(name)  # so the next checkpoint keeps it
            self.demotions[name] = steps


def _demote(layer: nn.Module) -> None:
    """The guard's switch, through the layer's PrecisionPlan (which projects guard_high_precision and tells its
    followers)."""
    from .precision_plan import demote_layer  # here: precision_plan imports the linear, whose op imports this module

    demote_layer(layer)
