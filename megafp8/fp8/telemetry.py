"""FP8 telemetry: per tensor amax, scale, fraction saturated and fraction flushed to zero; and a guard
that moves a persistently saturating layer to BF16.

Off by default; the training loop turns it on for the iterations it logs (every --log-interval), so the
extra elementwise pass over each quantized tensor is paid only on those. Values stay on the device until
collect_fp8_telemetry() reads them, once per logged iteration.
"""
from __future__ import annotations

import torch
from torch import nn

from megafp8_kernels import fp8_format


@torch.no_grad()
def record_fp8_stats(layer: nn.Module, role: str, x_hp: torch.Tensor, fp8, amax: torch.Tensor) -> None:
    """Store this quantization's statistics on `layer` under `role` (input, weight, grad_output)."""
    data, _ = fp8.row_major()
    restored = fp8.dequantize()
    x = x_hp.float()
    q = data.float().abs()
    fmt_max = fp8_format(fp8.fp8_dtype).max
    # Saturated: clipped to +-FP8_MAX although the value was larger. Flushed: nonzero but quantized to 0.
    saturated = ((q == fmt_max) & (x.abs() > restored.abs())).float().mean()
    flushed = ((x != 0) & (q == 0)).float().mean()
    layer.fp8_telemetry[role] = {
        "amax": amax.float().max(),
        "scale": 1.0 / fp8.scale_inv.float().min(),  # the largest scale of any group: tensorwise = the scale
        "saturated": saturated,
        "flushed_to_zero": flushed,
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
    consecutive checks. check() returns one message per switch, for the log."""

    def __init__(self, threshold: float = 1e-3, patience: int = 3):
        if not 0 <= threshold < 1 or patience < 1:
            raise ValueError(f"saturation guard needs 0 <= threshold < 1 and patience >= 1, got {threshold}, {patience}")
        self.threshold, self.patience = threshold, patience
        self.strikes: dict[str, int] = {}

    def check(self, model: nn.Module, iteration: int | None = None) -> list[str]:
        messages = []
        for name, module in model.named_modules():
            stats = getattr(module, "fp8_telemetry", None)
            if not stats or getattr(module, "force_high_precision", True):
                continue
            worst = max(s["saturated"].item() for s in stats.values())
            self.strikes[name] = self.strikes.get(name, 0) + 1 if worst > self.threshold else 0
            if self.strikes[name] >= self.patience:
                module.force_high_precision = True
                at = f" at iteration {iteration}" if iteration is not None else ""
                messages.append(f"fp8 guard: {name or 'model'} saturated {worst:.2%} > {self.threshold:.2%} for "
                                f"{self.patience} checks{at}: switched to BF16")
        return messages
