"""Learning-rate schedule with Megatron-LM's semantics: linear warm-up, then constant, linear, cosine,
inverse-square-root or WSD decay down to `min_lr`, measured in consumed samples.

Megatron counts its scheduler in samples (each iteration advances it by the global batch size) and
turns `--lr-warmup-iters` / `--lr-decay-iters` into samples the same way, so the same schedule serves
the `-iters` and the `-samples` flags. Here the schedule is a pure function of consumed samples: a
resumed run needs nothing but its data position to be on the same learning rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class LearningRateSchedule:
    """lr(consumed_samples). All lengths are in samples; see `from_iterations` for the -iters flags.
    `warmup_samples` may be fractional: Megatron's --lr-warmup-fraction x the decay length is not rounded."""

    max_lr: float
    min_lr: float
    warmup_samples: float
    decay_samples: int
    decay_style: str = "cosine"
    init_lr: float = 0.0  # the warm-up starts here (Megatron's --lr-warmup-init)
    wsd_decay_samples: int | None = None
    wsd_decay_style: str = "exponential"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {self.decay_style!r}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be within [0, --lr ({self.max_lr})]")
        if self.init_lr > self.max_lr:
            raise ValueError(f"--lr-warmup-init ({self.init_lr}) must not exceed --lr ({self.max_lr})")
        if self.decay_samples <= 0:
            raise ValueError("the LR decay length (--lr-decay-iters / --lr-decay-samples, default: the training "
                             f"length) must be positive, got {self.decay_samples} samples")
        if not 0 <= self.warmup_samples < self.decay_samples:
            raise ValueError(f"the LR warm-up ({self.warmup_samples} samples, --lr-warmup-iters/-samples) must be "
                             f"shorter than the decay ({self.decay_samples} samples, --lr-decay-iters/-samples)")
        if self.decay_style == "WSD":
            if self.wsd_decay_samples is None or not 0 < self.wsd_decay_samples <= self.decay_samples:
                raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters/-samples within the decay length")
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}")

    @classmethod
    def from_iterations(cls, *, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                        global_batch_size: int, **kw) -> LearningRateSchedule:
        """The -iters flags: Megatron converts iterations to samples with the global batch size."""
        wsd = kw.pop("wsd_decay_iters", None)
        return cls(max_lr=max_lr, min_lr=min_lr, warmup_samples=warmup_iters * global_batch_size,
                   decay_samples=decay_iters * global_batch_size,
                   wsd_decay_samples=None if wsd is None else wsd * global_batch_size, **kw)

    def __call__(self, consumed_samples: int) -> float:
        step, warmup, decay = consumed_samples, self.warmup_samples, self.decay_samples
        if warmup > 0 and step <= warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * step / warmup
        if self.decay_style == "constant":
            return self.max_lr
        if step > decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
        ratio = (step - warmup) / (decay - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: hold max_lr, then anneal over the last wsd_decay_samples
            anneal_start = decay - self.wsd_decay_samples
            coeff = 1.0 if step <= anneal_start else _wsd_coeff(self.wsd_decay_style,
                                                                 (step - anneal_start) / self.wsd_decay_samples)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def _wsd_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt
