"""FP8 telemetry: per tensor amax, scale, fraction saturated and fraction flushed to zero; and a guard
that moves a persistently saturating layer to high precision.

Off by default; the training loop turns it on for the iterations it logs (every --log-interval), so the
extra elementwise pass over each quantized tensor is paid only on those. That pass runs over row chunks of
at most TELEMETRY_CHUNK_ELEMENTS elements, so its fp32 temporaries stay bounded (16 MiB each) instead of
activation-sized. Values stay on the device until collect_fp8_telemetry() reads them, once per logged iteration.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megafp8_kernels import BLOCK, Granularity, expand_scale, fp8_format

TELEMETRY_CHUNK_ELEMENTS = 1 << 22


def saturation_threshold(fp8_dtype: torch.dtype) -> float:
    """The scaled magnitude above which a value is clipped rather than rounded: FP8_MAX plus half an ulp
    at FP8_MAX (E4M3: 464, E5M2: 61440). Anything below rounds to a representable value honestly."""
    fmt = fp8_format(fp8_dtype)
    top_exponent = math.frexp(fmt.max)[1] - 1
    return fmt.max + 0.5 * 2.0 ** (top_exponent - fmt.mantissa_bits)


def _row_chunks(rows: int, cols: int, gran: Granularity):
    """(start, stop) row ranges of at most TELEMETRY_CHUNK_ELEMENTS elements; whole 128-row blocks for 128x128."""
    step = max(1, TELEMETRY_CHUNK_ELEMENTS // max(cols, 1))
    if gran is Granularity.BLOCK_128X128:
        step = max(BLOCK, step // BLOCK * BLOCK)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _chunk_scale_inv(scale_inv: torch.Tensor, start: int, stop: int, cols: int, gran: Granularity) -> torch.Tensor:
    """The dequantization scales of rows start:stop, broadcastable against those rows."""
    if gran is Granularity.TENSORWISE:
        return scale_inv.float()
    if gran is Granularity.ROWWISE:
        return scale_inv[start:stop].float()
    if gran is Granularity.BLOCK_128X128:
        return expand_scale(scale_inv[start // BLOCK: -(-stop // BLOCK)].float(), stop - start, cols, gran)
    return expand_scale(scale_inv[start:stop].float(), stop - start, cols, gran)


@torch.no_grad()
def record_fp8_stats(layer: nn.Module, role: str, x_hp: torch.Tensor, fp8, amax: torch.Tensor) -> None:
    """Store this quantization's statistics on `layer` under `role` (input, weight, grad_output)."""
    data, scale_inv = fp8.row_major()
    rows, cols = data.shape
    threshold = saturation_threshold(fp8.fp8_dtype)
    saturated = torch.zeros((), dtype=torch.int64, device=data.device)
    flushed = torch.zeros_like(saturated)
    for start, stop in _row_chunks(rows, cols, fp8.granularity):
        x = x_hp[start:stop]
        # Saturated: |x| * scale past FP8_MAX by more than rounding (a group's own amax maps to FP8_MAX and
        # is not clipped). Flushed: nonzero but quantized to +-0 (read on the FP8 bytes, sign bit masked).
        clip_level = threshold * _chunk_scale_inv(scale_inv, start, stop, cols, fp8.granularity)
        saturated += (x.float().abs() > clip_level).sum()
        flushed += ((x != 0) & ((data[start:stop].view(torch.uint8) & 0x7F) == 0)).sum()
    numel = max(rows * cols, 1)
    layer.fp8_telemetry[role] = {
        "amax": amax.float().max(),
        "scale": 1.0 / scale_inv.float().min(),  # the largest scale of any group: tensorwise = the scale
        "saturated": (saturated / numel).float(),
        "flushed_to_zero": (flushed / numel).float(),
    }


def enable_fp8_telemetry(model: nn.Module, enabled: bool = True) -> None:
    for module in model.modules():
        if hasattr(module, "fp8_telemetry"):
            module.telemetry_enabled = enabled


def collect_fp8_telemetry(model: nn.Module) -> dict[str, float]:
    """Flat {"fp8/<layer>/<role>/<stat>": value} of the latest recorded statistics (one host sync)."""
    keys, values = [], []
    for name, module in model.named_modules():
        for role, stats in getattr(module, "fp8_telemetry", {}).items():
            for stat, value in stats.items():
                keys.append(f"fp8/{name}/{role}/{stat}")
                values.append(value.reshape(()))
    if not values:
        return {}
    return dict(zip(keys, torch.stack(values).tolist()))


class SaturationGuard:
    """Switch a layer to high precision when its saturated fraction stays above `threshold` for `patience`
    consecutive checks. check() returns one message per switch, for the console; `events` collects the
    same switches as records ({"iteration", "layer", "saturated"}) until take_events() drains them for
    metrics.jsonl. A switched layer's telemetry is dropped: it quantizes nothing any more.

    all_reduce_max: in-place MAX over the ranks that share the layers (the TP x DP group). Every rank must
    take the same decision, or ranks would disagree on the precision (and the collectives) of a layer.
    state_dict() / load_state_dict(state, model) carry the strikes and the switched layers, so a resumed
    run keeps its switches (the model's own state dict stays free of it, and so HF-convertible).
    """

    # Default threshold 1%: delayed scaling clips ~0.2% of an MLP's FC2 input for a few steps while activations
    # grow during LR warm-up (measured in the 500-step parity run, docs/parity), a transient that should not
    # cost a layer its FP8 for the rest of the run; persistent saturation above 1% is a real problem.
    def __init__(self, threshold: float = 1e-2, patience: int = 3,
                 all_reduce_max: Callable[[torch.Tensor], None] | None = None):
        if not 0 <= threshold < 1 or patience < 1:
            raise ValueError(f"saturation guard needs 0 <= threshold < 1 and patience >= 1, got {threshold}, {patience}")
        self.threshold, self.patience = threshold, patience
        self.all_reduce_max = all_reduce_max
        self.strikes: dict[str, int] = {}
        self.switched: set[str] = set()
        self.events: list[dict] = []

    def check(self, model: nn.Module, iteration: int | None = None) -> list[str]:
        layers = [(name, module) for name, module in model.named_modules()
                  if getattr(module, "fp8_telemetry", None) and not module.runs_high_precision]
        if not layers:
            return []
        worst = torch.stack([torch.stack([s["saturated"] for s in m.fp8_telemetry.values()]).max() for _, m in layers])
        if self.all_reduce_max is not None:
            self.all_reduce_max(worst)
        messages = []
        for (name, module), fraction in zip(layers, worst.tolist()):
            self.strikes[name] = self.strikes.get(name, 0) + 1 if fraction > self.threshold else 0
            if self.strikes[name] >= self.patience:
                module.guard_high_precision = True
                module.fp8_telemetry.clear()
                self.switched.add(name)
                self.events.append({"iteration": iteration, "layer": name, "saturated": fraction})
                at = f" at iteration {iteration}" if iteration is not None else ""
                messages.append(f"fp8 guard: {name or 'model'} saturated {fraction:.2%} > {self.threshold:.2%} for "
                                f"{self.patience} checks{at}: switched to high precision")
        return messages

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def state_dict(self) -> dict:
        return {"strikes": dict(self.strikes), "switched": sorted(self.switched)}

    def load_state_dict(self, state: dict, model: nn.Module) -> None:
        self.strikes = dict(state.get("strikes", {}))
        modules = dict(model.named_modules())
        for name in state.get("switched", []):
            if name not in modules:
                raise KeyError(f"saturation guard state names layer {name!r}, which this model does not have")
            modules[name].guard_high_precision = True
            modules[name].fp8_telemetry.clear()
            self.switched.add(name)  # so the next checkpoint keeps it
