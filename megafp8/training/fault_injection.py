"""Test hooks that fault a training step (unset in real runs), and ``FaultInjection``, which wires every hook the
environment sets to one rank's model.

    MEGAFP8_INJECT_NAN_AT_ITERATION=N
        iteration N's loss is NaN on the logging rank, on every attempt (a NaN loss mask): the skipped-step tests.
    MEGAFP8_FORCE_FP8_OVERFLOW / MEGAFP8_FORCE_OUTLIER
        an FP8 layer's overflow or growing outlier (megafp8.fp8.forced_overflow / forced_outlier): the guard's tests.
    MEGAFP8_TEST_LOSS_FAULT=KIND:RANK@ITERATION[xFACTOR][:once][,...]
        KIND nan: RANK's loss at ITERATION is NaN (a NaN loss mask, so its gradients are too);
        KIND spike: RANK's logits at ITERATION are FACTOR (default 100) x larger, and so its loss and gradients
        (a loss mask could not: the loss is a masked mean).
        ``once``: on the first attempt only, as a flaky device would (a re-run of the step passes: transient);
        without it every attempt is faulted (persistent, as numerics or data would be). RANK is a global rank
        of the last pipeline stage (the ranks that compute a loss).
    MEGAFP8_TEST_POISON_SAMPLE=INDEX@MODULE      e.g. 37@layers.1.mlp
        the training sample INDEX (its index in the training split, as the flight record names samples) makes
        MODULE's output NaN in its batch row, on every attempt: a poisoned sample, whose flight record must name
        it and MODULE as the first non-finite layer.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from megafp8.fp8.forced_outlier import ForcedOutlier
from megafp8.fp8.forced_overflow import ForcedOverflow
from megafp8.training.stopping import on_any_rank

LOSS_FAULT_ENV = "MEGAFP8_TEST_LOSS_FAULT"
POISON_SAMPLE_ENV = "MEGAFP8_TEST_POISON_SAMPLE"
_FAULT = re.compile(r"^(?P<kind>nan|spike):(?P<rank>\d+)@(?P<iteration>\d+)(x(?P<factor>\d+(\.\d*)?))?(?P<once>:once)?$")
_POISON = re.compile(r"^(?P<index>\d+)@(?P<module>[\w.]+)$")


@dataclass(frozen=True)
class LossFault:
    kind: str
    rank: int
    iteration: int
    factor: float
    once: bool

    @classmethod
    def all_from_env(cls, environ: Mapping[str, str] = os.environ) -> list[LossFault]:
        faults = []
        for spec in filter(None, (s.strip() for s in environ.get(LOSS_FAULT_ENV, "").split(","))):
            match = _FAULT.match(spec)
            if match is None:
                raise ValueError(f"{LOSS_FAULT_ENV}={spec!r}: expected KIND:RANK@ITERATION[xFACTOR][:once] with KIND "
                                 "nan or spike, e.g. nan:1@3:once or spike:0@5x100")
            faults.append(cls(match["kind"], int(match["rank"]), int(match["iteration"]),
                              float(match["factor"] or 100), match["once"] is not None))
        return faults

    def applies(self, rank: int, iteration: int, attempt: int) -> bool:
        return rank == self.rank and iteration == self.iteration and not (self.once and attempt > 0)


class LogitSpike:
    """A forward hook on the output layer that multiplies the logits by ``factor`` (1: off), set per step."""

    def __init__(self, model: nn.Module) -> None:
        self.factor = 1.0
        module = dict(model.named_modules()).get("output_layer")
        if module is not None:
            module.register_forward_hook(self._scale)

    def _scale(self, module: nn.Module, args: tuple, output):
        return output * self.factor if self.factor != 1.0 and isinstance(output, torch.Tensor) else None


class PoisonedSample:
    """MEGAFP8_TEST_POISON_SAMPLE: a forward hook on one module NaNs the batch row of one training sample. The
    trainer arms it each step with this rank's sample indices per micro-batch; the module's n-th forward call of the
    step (with grad, so not a recompute) is micro-batch n, as every schedule runs a chunk's micro-batches in order."""

    def __init__(self, index: int, module: str) -> None:
        self.index, self.module = index, module
        self.micro_batches: list[list[int]] = []
        self.calls = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PoisonedSample | None:
        spec = environ.get(POISON_SAMPLE_ENV, "").strip()
        if not spec:
            return None
        match = _POISON.match(spec)
        if match is None:
            raise ValueError(f"{POISON_SAMPLE_ENV}={spec!r}: expected INDEX@MODULE, e.g. 37@layers.1.mlp")
        return cls(int(match["index"]), match["module"])

    def target(self, model: nn.Module) -> nn.Module | None:
        module = dict(model.named_modules()).get(self.module)
        if module is not None:
            module.register_forward_hook(self._poison)
        return module

    def arm(self, micro_batches: list[list[int]]) -> None:
        self.micro_batches, self.calls = micro_batches, 0

    def _poison(self, module: nn.Module, args: tuple, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or output.dim() != 3:
            return None
        call, self.calls = self.calls, self.calls + 1
        samples = self.micro_batches[call] if call < len(self.micro_batches) else []
        if self.index not in samples:
            return None
        poisoned = output.clone()
        poisoned[:, samples.index(self.index)] = float("nan")  # activations are [seq, batch, hidden]
        return poisoned


def rank_sample_indices(consumed_samples: int, micro_batch_size: int, num_micro_batches: int, dp_rank: int,
                        dp_size: int) -> list[list[int]]:
    """The training-split indices of one DP rank's micro-batches of the global batch starting at
    ``consumed_samples`` (megafp8.data.sampler's order: each global micro-batch split in DP-rank order)."""
    step = micro_batch_size * dp_size
    return [[consumed_samples + m * step + dp_rank * micro_batch_size + j for j in range(micro_batch_size)]
            for m in range(num_micro_batches)]


class FaultInjection:
    """Every test hook the environment sets, looked up once on this rank's model (each checked to name something
    some rank holds); ``arm`` before each attempt of a step, ``loss_mask`` for its loss mask."""

    def __init__(self, model: nn.Module, rank: int, computes_loss: bool, announce: bool) -> None:
        self.rank = rank
        self.nan_at_iteration = int(os.environ.get("MEGAFP8_INJECT_NAN_AT_ITERATION", "0")) if computes_loss else 0
        self.layer_hooks = []  # [(hook, its layer on this rank or None)]
        for hook in filter(None, (ForcedOverflow.from_env(), ForcedOutlier.from_env())):
            layer = hook.target(model)
            if not on_any_rank(layer is not None):
                raise ValueError(f"{hook.ENV}: the model has no layer {hook.layer!r} (names as in the FP8 telemetry "
                                 "tags, e.g. layers.0.mlp.linear_fc2)")
            if announce:
                print(f" test hook {hook.ENV}: {hook.describe()}", flush=True)
            self.layer_hooks.append((hook, layer))
        self.loss_faults = LossFault.all_from_env()
        for fault in self.loss_faults:
            if not on_any_rank(fault.rank == rank and computes_loss):
                raise ValueError(f"{LOSS_FAULT_ENV}: rank {fault.rank} computes no loss (not a rank of the last "
                                 "pipeline stage)")
        self.logit_spike = LogitSpike(model) if any(f.kind == "spike" for f in self.loss_faults) else None
        self.poisoned_sample = PoisonedSample.from_env()
        if self.poisoned_sample is not None and not on_any_rank(self.poisoned_sample.target(model) is not None):
            raise ValueError(f"{POISON_SAMPLE_ENV}: the model has no module {self.poisoned_sample.module!r}")

    def arm(self, iteration: int, attempt: int, micro_batches: list[list[int]]) -> None:
        """Before an attempt of step ``iteration`` whose micro-batches hold these training-split indices."""
        for hook, layer in self.layer_hooks:
            if layer is not None:
                hook.arm(layer, iteration)
        if self.logit_spike is not None:
            self.logit_spike.factor = next((f.factor for f in self.loss_faults if f.kind == "spike"
                                            and f.applies(self.rank, iteration, attempt)), 1.0)
        if self.poisoned_sample is not None:
            self.poisoned_sample.arm(micro_batches)

    def loss_mask(self, shape: torch.Size, iteration: int, attempt: int) -> torch.Tensor | None:
        """A NaN loss mask where a hook asks for one, else None (every token counts)."""
        nan = iteration == self.nan_at_iteration or any(
            f.kind == "nan" and f.applies(self.rank, iteration, attempt) for f in self.loss_faults)
        return torch.full(shape, float("nan")) if nan else None
