"""--fp16's loss scaling: Megatron-LM's dynamic loss scaler (or --loss-scale's constant one), kept on the device.

The step multiplies each micro-batch's loss by ``scale`` before backward (fp16 gradients then stay above fp16's
subnormals), the optimizer divides the gradients by it before the norm, the clip and the update, and a step whose
gradients are not finite is skipped on every rank (the optimizer's finite flag). After the step ``update(found_inf)``
moves the scale by Megatron-Core's rule (``megatron.core.optimizer.grad_scaler.DynamicGradScaler``):

- an overflow resets the growth count and spends one unit of hysteresis; with none left, the scale halves (not below
  --min-loss-scale);
- --loss-scale-window clean steps in a row double it and restore the hysteresis (--hysteresis).

Everything is a device tensor updated with ``torch.where``: no step asks the host whether it overflowed.
"""
from __future__ import annotations

import torch

GROWTH_FACTOR, BACKOFF_FACTOR = 2.0, 0.5  # Megatron-LM's fixed factors


class LossScaler:
    """A constant scale: --fp16 --loss-scale S (Megatron-LM's ConstantGradScaler)."""

    def __init__(self, scale: float, device: torch.device | str = "cpu") -> None:
        if not scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self.scale = torch.tensor(float(scale), dtype=torch.float32, device=device)

    def inverse(self) -> torch.Tensor:
        """1 / scale: exact for the dynamic scaler's powers of two, rounded once for a --loss-scale constant."""
        return torch.ones_like(self.scale) / self.scale

    def update(self, found_inf: torch.Tensor) -> None:
        """A constant scale does not move."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.detach().clone()}

    def live_state(self) -> dict[str, torch.Tensor]:
        """The scale and trackers themselves (not copies): what a step re-run restores in place."""
        return {name: getattr(self, name) for name in ("scale", "growth_tracker", "hysteresis_tracker")
                if hasattr(self, name)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale.copy_(state["scale"])


class DynamicLossScaler(LossScaler):
    """Megatron-Core's DynamicGradScaler with device-side trackers (module docstring)."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 device: torch.device | str = "cpu") -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale ({min_scale}) must be > 0 and <= --initial-loss-scale "
                             f"({initial_scale})")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"--loss-scale-window ({growth_interval}) and --hysteresis ({hysteresis}) must be >= 1")
        super().__init__(initial_scale, device)
        self.min_scale = torch.tensor(float(min_scale), dtype=torch.float32, device=device)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = torch.zeros((), dtype=torch.int64, device=device)
        self.hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor) -> None:
        found_inf = found_inf.to(self.scale.device)
        growth = torch.where(found_inf, 0, self.growth_tracker + 1)
        hysteresis = torch.where(found_inf, self.hysteresis_tracker - 1, self.hysteresis_tracker)
        grow = ~found_inf & (growth == self.growth_interval)
        back_off = found_inf & (hysteresis <= 0)
        scale = torch.where(back_off, torch.maximum(self.scale * BACKOFF_FACTOR, self.min_scale),
                            torch.where(grow, self.scale * GROWTH_FACTOR, self.scale))
        self.scale.copy_(scale)
        self.growth_tracker.copy_(torch.where(grow, 0, growth))
        self.hysteresis_tracker.copy_(torch.where(grow, self.hysteresis, hysteresis))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), "growth_tracker": self.growth_tracker.detach().clone(),
                "hysteresis_tracker": self.hysteresis_tracker.detach().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.growth_tracker.copy_(state["growth_tracker"])
        self.hysteresis_tracker.copy_(state["hysteresis_tracker"])


def loss_scaler_from_args(args, device: torch.device | str) -> LossScaler | None:
    """The run's scaler: None without --fp16; --loss-scale's constant; else the dynamic one."""
    if not args.fp16:
        return None
    if args.loss_scale is not None:
        return LossScaler(args.loss_scale, device)
    return DynamicLossScaler(args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window, args.hysteresis,
                             device)


def loss_scale_errors(args) -> list[str]:
    """--fp16 and its loss-scale flags' problems, one line each. Megatron-LM reads the loss-scale flags only with
    --fp16; they are checked either way, since a bad value is a typo whether or not --fp16 is given."""
    errors = []
    if args.fp16 and args.bf16:
        errors.append("--fp16 and --bf16 are exclusive")
    if args.loss_scale is not None and not args.loss_scale > 0:
        errors.append(f"--loss-scale must be positive, got {args.loss_scale}")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        errors.append(f"--min-loss-scale ({args.min_loss_scale}) must be positive and at most --initial-loss-scale "
                      f"({args.initial_loss_scale})")
    for name in ("loss_scale_window", "hysteresis"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return errors
