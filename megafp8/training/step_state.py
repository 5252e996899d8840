"""StepState: what a bit-exact re-run of one training step needs, captured on the host before it and restored after.

A step re-run (on a failure or a suspicious loss) goes back to the start of the step and runs its phases again
(megafp8.training.train.Trainer.train_step: forward_backward, update_fp8_scales, prepare_optimizer_step,
apply_optimizer_step). ``StepState.capture(trainer)`` before the step, ``restore(trainer)`` any time before
``apply_optimizer_step``: the re-run then gives the same loss, grad norm and, once applied, parameters, bit for
bit, as a run that never went back.

Captured:
    every RNG state (python, numpy, torch CPU, all CUDA devices, the model-parallel dropout tracker), the data
    position (the progress counters: consumed samples; restore rebuilds the training batch iterator there, as a
    resume does, its data loader started outside the restored RNG state when the replaced one had started),
    the FP8 delayed-scaling state (amax histories, scales, the pending amaxes, and the host-side update clock and
    cold/warm marks the FP8 weight caches are keyed on), the saturation guard's strikes and lagged flags, the
    iteration / skipped / NaN counters, and the optimizer's step and skipped counts.
Not captured, because a re-run happens before ``apply_optimizer_step`` changes them:
    the parameters, the master weights and the optimizer moments (and the fp16 master's scales), the published
    FP8 weights. The grads need nothing: forward_backward zeroes the grad buffer first. A restore after a layer
    was switched to high precision by the guard (which runs in apply_optimizer_step) is refused.
Neither: the communication byte counters, the profiler and the FP8 telemetry of the last step (the re-run's
traffic is counted, its statistics overwrite the first attempt's).

Capturing asks the device nothing: device tensors are copied into pinned host memory without blocking (stream
order puts those copies before anything that could overwrite the tensors, and before a restore's copies back).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from megafp8.checkpoint.rng import capture_rng_state, restore_rng_state
from megafp8.fp8 import Fp8GemmModule
from megafp8.fp8.scaling_state import ScalingSnapshot
from megafp8.training.data_setup import batches, close_batches


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``; from a GPU into pinned memory, without waiting for the device."""
    on_gpu = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
    return host.copy_(tensor, non_blocking=on_gpu)


def _copy_back(target: torch.Tensor, host: torch.Tensor) -> None:
    target.copy_(host, non_blocking=target.device.type == "cuda")


@dataclass
class StepState:
    """Everything of a trainer that one step changes before its optimizer update (module docstring), on the host."""

    progress: Any                      # a copy of the TrainProgress (iteration, consumed samples, ...)
    rng: dict[str, Any]
    fp8_scaling: ScalingSnapshot | None  # Fp8ScalingManager.snapshot()
    guard: dict | None                   # SaturationGuard.snapshot()
    counters: dict[str, torch.Tensor]  # host copies of device counters, by the attribute path they restore to
    data_started: bool                 # whether the training batch iterator had read anything

    @classmethod
    def capture(cls, trainer) -> StepState:
        pipeline = trainer.pipeline
        return cls(progress=dataclasses.replace(trainer.progress),
                   rng=capture_rng_state(pipeline.chunks[0].rng),
                   fp8_scaling=pipeline.fp8_manager.snapshot(_to_host) if pipeline.fp8_manager else None,
                   guard=trainer.guard.snapshot() if trainer.guard is not None else None,
                   counters={path: _to_host(tensor) for path, tensor in _device_counters(trainer).items()},
                   data_started=_has_started(trainer.train_batches))

    def restore(self, trainer) -> None:
        """Back to the captured state: the next ``train_step`` (or its phases) re-runs the captured step."""
        if self.guard is not None:  # first: it refuses a restore it cannot honour, before anything changed
            trainer.guard.restore(self.guard)
        for field in dataclasses.fields(self.progress):
            setattr(trainer.progress, field.name, getattr(self.progress, field.name))
        restore_rng_state(self.rng, trainer.pipeline.chunks[0].rng)
        if self.fp8_scaling is not None:
            trainer.pipeline.fp8_manager.restore(self.fp8_scaling, _copy_back)
            # With the scale version back where it was, a weight the first attempt cached would be reused without
            # observing its amax again: drop those caches (not an injected --fp8-param-gather weight, published
            # before the step, its amax already in the restored pending amaxes).
            for module in trainer.pipeline.modules.modules():
                if isinstance(module, Fp8GemmModule):
                    module.drop_quantized_weight_cache()
        trainer.optimizer.pending_stats = None  # a prepare() of the dropped attempt: the re-run prepares again
        counters = _device_counters(trainer)
        for path, host in self.counters.items():
            _copy_back(counters[path], host)
        # The data position: a new iterator from the consumed samples, as a resumed run builds it.
        close_batches(trainer.train_batches)
        source = batches(trainer.train_data, self.progress.consumed_samples, trainer.args, trainer.ps)
        if self.data_started:
            # A data loader draws its base seed from the global CPU generator when it starts, which the replaced
            # iterator did before the capture: the new one starts outside the restored generator state.
            with torch.random.fork_rng(devices=[]):
                first = next(source, _END)
            source = _Resumed(first, source)
        trainer.train_batches = source


_END = object()


class _Resumed:
    """A batch iterator whose first batch was read ahead."""

    def __init__(self, first, rest) -> None:
        self._first, self._rest = first, rest

    def __iter__(self):
        return self

    def __next__(self):
        first, self._first = self._first, None
        if first is _END:
            raise StopIteration
        return next(self._rest) if first is None else first

    def close(self) -> None:  # close_batches: the data-loader workers exit with it
        self._rest.close()


def _has_started(source) -> bool:
    """Whether a batch iterator has read anything (a generator not yet run has not)."""
    return not (inspect.isgenerator(source) and inspect.getgeneratorstate(source) == inspect.GEN_CREATED)


def _device_counters(trainer) -> dict[str, torch.Tensor]:
    """The counters a step moves on the device: the optimizer's step and skipped counts (and --fp16's loss scale),
    the result checks' spike reference, and the trainer's skipped / NaN iterations not yet folded into its
    progress (those exist once ``train()`` runs)."""
    counters = {f"optimizer.{name}": tensor for name, tensor in trainer.optimizer.device_counters().items()}
    rerun = getattr(trainer, "rerun", None)
    if rerun is not None:
        counters.update({f"result_checks.{name}": t for name, t in rerun.checks.device_state().items()})
    for name in ("_new_skipped", "_new_nan"):
        if hasattr(trainer, name):
            counters[f"trainer.{name}"] = getattr(trainer, name)
    return counters
