"""Kurtosis of the FP8 layers' inputs: FOG's early warning of outlier growth, as telemetry and a warning line.

The kurtosis of a tensor's elements is ``E[(x - mean)^4] / Var(x)^2`` (3 for a Gaussian, 6 for a Laplace; outlier
features push it up long before a cast saturates). A layer with ``kurtosis_enabled`` keeps the raw moments of its
input, ``[n, sum x, sum x^2, sum x^3, sum x^4]`` in fp64 on the device, computed where the input is quantized (the
normalized input of a fused RMSNorm prologue, the SwiGLU output of FC2's), summed over the step's micro-batches.
The trainer turns it on for the steps that log FP8 telemetry only (one reduction pass over each input then, none
otherwise), sums the moments over the tensor-parallel group (sequence shards under SP, hidden slices of a
row-parallel input, or identical copies, which leave the ratios unchanged), and derives kurtosis and RMS: the same
values at any TP layout.

``KurtosisWarning``: a layer whose kurtosis reaches ``ratio`` x its lowest value over the previous ``window``
logged values gets one warning (again only after it fell back below that bound); with
--fp8-saturation-guard-kurtosis the saturation guard switches that layer at once (SaturationGuard.switch_early).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

def input_moments(x: torch.Tensor) -> torch.Tensor:
    """``[n, sum x, sum x^2, sum x^3, sum x^4]`` of ``x``'s elements, fp64, on x's device (no host sync)."""
    x = x.detach().double().reshape(-1)
    x2 = x * x
    return torch.stack([torch.full((), float(x.numel()), dtype=torch.float64, device=x.device), x.sum(), x2.sum(),
                        (x2 * x).sum(), (x2 * x2).sum()])


def kurtosis_and_rms(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kurtosis, RMS) from raw moments (``[..., 5]``): the central fourth moment over the squared variance."""
    n, s1, s2, s3, s4 = moments.double().unbind(-1)
    mean, m2, m3, m4 = s1 / n, s2 / n, s3 / n, s4 / n
    variance = m2 - mean * mean
    central4 = m4 - 4 * mean * m3 + 6 * mean * mean * m2 - 3 * mean ** 4
    return central4 / (variance * variance), torch.sqrt(m2)


def record_input_moments(layer: nn.Module, x: torch.Tensor) -> None:
    """Add ``x``'s moments to ``layer``'s (the FP8 op calls it while ``layer.kurtosis_enabled``): the step's
    micro-batches together, as the loss. Inside a compiled graph, which cannot store a new reference on the layer,
    they go into the slot ``add_moments_slot`` gave it (zeroed by ``enable_kurtosis``). A forward recomputed in
    backward adds nothing (eagerly; a compiled one replays its graph, counting its micro-batch twice, which leaves
    every ratio unchanged when every micro-batch is recomputed alike)."""
    if torch.compiler.is_compiling():
        layer.__dict__["input_moments_slot"].add_(input_moments(x))
    elif torch._C._current_graph_task_id() == -1:
        moments = input_moments(x)
        layer.input_moments = moments if layer.input_moments is None else layer.input_moments + moments


def add_moments_slot(layer: nn.Module, device: torch.device) -> None:
    """Give ``layer`` moments it owns, added to in place by its compiled graph (call it eagerly before each compiled
    call, as the FP8 telemetry's slots: megafp8.model.compile)."""
    slot = layer.__dict__.get("input_moments_slot")
    if slot is None:
        slot = layer.__dict__["input_moments_slot"] = torch.zeros(5, dtype=torch.float64, device=device)
    layer.input_moments = slot


def enable_kurtosis(model: nn.Module, enabled: bool) -> None:
    """Record the FP8 layers' input moments from now on (from zero), or stop and drop them."""
    for module in model.modules():
        if hasattr(module, "fp8_telemetry"):
            module.kurtosis_enabled = enabled
            module.input_moments = None
            slot = module.__dict__.get("input_moments_slot")
            if enabled and slot is not None:
                slot.zero_()


def collect_kurtosis(model: nn.Module, all_reduce_sum=None) -> dict[str, float]:
    """``{"fp8/<layer>/input/kurtosis": k, "fp8/<layer>/input/rms": r}`` of the layers that recorded moments since
    ``enable_kurtosis``; ``all_reduce_sum``: in-place SUM over the tensor-parallel group (every rank of it calls, with
    the same layers). One collective and one host read."""
    names, moments = [], []
    for name, module in model.named_modules():
        recorded = getattr(module, "input_moments", None)
        if recorded is not None:
            names.append(name)
            moments.append(recorded)
    if not moments:
        return {}
    stacked = torch.stack(moments)
    if all_reduce_sum is not None:
        all_reduce_sum(stacked)
    kurtosis, rms = kurtosis_and_rms(stacked)
    values = torch.stack([kurtosis, rms], dim=1).tolist()
    out = {}
    for name, (k, r) in zip(names, values):
        out[f"fp8/{name}/input/kurtosis"], out[f"fp8/{name}/input/rms"] = k, r
    return out


@dataclass(frozen=True)
class KurtosisAlarm:
    """One layer's warning: its kurtosis now, the lowest of its window, and the console line."""
    layer: str
    kurtosis: float
    low: float
    message: str


class KurtosisWarning:
    """One alarm per layer whose input kurtosis grew ``ratio`` x past its lowest of the last ``window`` logs."""

    def __init__(self, ratio: float = 2.0, window: int = 5) -> None:
        if ratio <= 1 or window < 1:
            raise ValueError(f"--kurtosis-warning-ratio must be > 1 and --kurtosis-warning-window >= 1, got "
                             f"{ratio}, {window}")
        self.ratio, self.window = ratio, window
        self.history: dict[str, deque] = {}
        self.warned: set[str] = set()

    def check(self, iteration: int, telemetry: dict[str, float]) -> list[KurtosisAlarm]:
        alarms = []
        for key, value in telemetry.items():
            if not key.endswith("/input/kurtosis"):
                continue
            layer = key[len("fp8/"):-len("/input/kurtosis")]
            history = self.history.setdefault(layer, deque(maxlen=self.window))
            low = min(history) if history else None
            if low is not None and low > 0 and value >= self.ratio * low:
                if layer not in self.warned:
                    self.warned.add(layer)
                    alarms.append(KurtosisAlarm(layer, value, low, (
                        f"kurtosis warning at iteration {iteration}: {layer}'s input kurtosis {value:.1f} is "
                        f"{value / low:.1f}x its lowest of the last {len(history)} logs ({low:.1f}): outliers are "
                        "growing (FOG's early sign of FP8 divergence)")))
            else:
                self.warned.discard(layer)
            history.append(value)
        return alarms

    def state_dict(self) -> dict:
        """The windows and the warned layers: a resumed run warns (and, with the guard, switches) as this one would."""
        return {"history": {layer: list(values) for layer, values in self.history.items()},
                "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.history = {layer: deque(values, maxlen=self.window) for layer, values in state["history"].items()}
        self.warned = set(state["warned"])
