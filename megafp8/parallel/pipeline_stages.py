"""torch.distributed.pipelining's stages with megafp8's additions, and its schedules by their megafp8 names: every send
charged to ``pp_p2p``, and a zero-bubble stage's FP8 weight gradients split off into W (megafp8.fp8.deferred_wgrad).
Imported only where PP > 1 (megafp8.parallel.pipeline): torch's pipelining imports torch._dynamo, ~0.7 s of a
process's start that a PP = 1 run does not need."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from megafp8.fp8.deferred_wgrad import WgradDeferral
from megafp8.parallel import collectives as C

_SCHEDULE_CLASSES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                     "interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                     "dualpipev": ScheduleDualPipeV}


def make_schedule(name: str, stages: list, num_microbatches: int, loss_fn: Callable):
    """torch's schedule called ``name`` (--pipeline-schedule) over this rank's stages."""
    schedule_class = _SCHEDULE_CLASSES[name]
    if schedule_class is Schedule1F1B:
        return Schedule1F1B(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


class CountedStage(PipelineStage):
    """torch's PipelineStage with every activation / gradient send charged to ``pp_p2p``."""

    def __init__(self, *args, counters: C.CommCounters, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._counters = counters

    def _count(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            self._counters.add("pp_p2p", op.tensor.numel() * op.tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id))


class DeferringStage(CountedStage):
    """A zero-bubble stage whose FP8 weight gradients are split off into W by the chunk's WgradDeferral."""

    def __init__(self, *args, deferral: WgradDeferral, **kwargs) -> None:
        super().__init__(*args, dw_builder=deferral.take, **kwargs)
        self._deferral = deferral

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        with self._deferral.deferring():  # a full backward (B then W at once) defers too: dw_builder()() runs it
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":  # with a dw_builder torch only asks for "full"
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        return _backward_except(bwd_kwargs, self.submod.parameters(), self._deferral.expected), None


def _flat_tensors(value, grad, outputs: list, grads: list) -> None:
    if isinstance(value, torch.Tensor):
        if value.requires_grad or value.grad_fn is not None:
            outputs.append(value)
            grads.append(grad)
    elif isinstance(value, (tuple, list)) and grad is not None:
        for v, g in zip(value, grad):
            _flat_tensors(v, g, outputs, grads)
    elif isinstance(value, (tuple, list)):  # the last stage's loss comes without output grads
        for v in value:
            _flat_tensors(v, None, outputs, grads)


def _backward_except(bwd_kwargs: dict, params, deferred: set) -> tuple[torch.Tensor | None, ...]:
    """torch's stage_backward, with the deferred FP8 weights left out of autograd's ``inputs``: their
    AccumulateGrad (and grad-buffer hooks) run in W, from the deferral, not here."""
    outputs: list[torch.Tensor] = []
    grads: list[torch.Tensor | None] = []
    _flat_tensors(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], outputs, grads)
    values = bwd_kwargs["input_values"]
    inputs = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    inputs += [p for p in dict.fromkeys(params) if p.requires_grad and p not in deferred]
    if not inputs:  # an empty list would mean "every leaf" to autograd
        raise RuntimeError("zero-bubble FP8 stage: nothing but FP8 weights needs a gradient in B")
    torch.autograd.backward(outputs, grad_tensors=grads, inputs=inputs)
    grad_inputs = []
    for v in values:
        grad_inputs.append(v.grad if isinstance(v, torch.Tensor) else None)
        if isinstance(v, torch.Tensor):
            v.grad = None  # sent on; as torch's stage_backward, free it once the send is done
    return tuple(grad_inputs)
