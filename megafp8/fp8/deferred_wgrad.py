"""Deferred FP8 weight gradients: a zero-bubble schedule's B pass computes only dgrad and queues each FP8
linear's wgrad (its FP8 operands), the W pass runs the queue into ``main_grad`` exactly once.

One ``WgradDeferral`` per pipeline chunk, attached to the chunk's FP8 layers (``layer.wgrad_deferral``):

- forward (training): the FP8 op ``expect()``s its weight: that weight's gradient will come from W, so
  the stage leaves it out of B's autograd ``inputs`` (its AccumulateGrad node, and with it the
  post-accumulate-grad hooks that feed the DDP grad buffer and start overlapped reductions, do not run
  in B);
- B (inside ``deferring()``): the op pushes a closure holding ``dY^T`` / ``x^T`` in FP8 plus their scales
  (and, under sequence parallelism, the local ``x^T`` shard whose TP gather then runs in W);
- the stage's ``dw_builder`` calls ``take()`` right after B: the returned closure, run in W, computes each
  queued wgrad, adds it into ``main_grad`` (or accumulates ``.grad`` like AccumulateGrad when there is no
  grad buffer) and fires the weight's post-accumulate-grad hooks once, as the unsplit backward would.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

WgradFn = Callable[[], "torch.Tensor | None"]


class WgradDeferral:
    """The deferred weight gradients of one pipeline chunk (see the module docstring)."""

    def __init__(self) -> None:
        self.expected: set[torch.nn.Parameter] = set()  # weights whose gradient W delivers
        self._queue: list[tuple[torch.nn.Parameter, WgradFn, int]] = []
        self._active = False
        self.peak_bytes = 0  # most FP8 operand bytes held between a B and its W (bench_pipeline_bubble.py)
        self._held_bytes = 0

    @property
    def active(self) -> bool:
        return self._active

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside: FP8 linears of this chunk queue their wgrad instead of computing it."""
        self._active, previous = True, self._active
        try:
            yield
        finally:
            self._active = previous

    def expect(self, weight: torch.nn.Parameter) -> None:
        self.expected.add(weight)

    def push(self, weight: torch.nn.Parameter, fn: WgradFn, held: tuple[torch.Tensor, ...]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in held if t is not None)
        self._queue.append((weight, fn, nbytes))
        self._held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)

    def take(self) -> Callable[[], None]:
        """The W closure of the wgrads queued since the last take (one B's worth)."""
        entries, self._queue = self._queue, []
        return lambda: self._run(entries)

    def _run(self, entries: list[tuple[torch.nn.Parameter, WgradFn, int]]) -> None:
        for weight, fn, nbytes in entries:
            grad = fn()  # None: added into main_grad already
            if grad is not None:  # what AccumulateGrad would have done with it
                weight.grad = grad if weight.grad is None else weight.grad + grad
            # The hooks B skipped (the weight was not among its autograd inputs): the DDP grad buffer counts
            # this backward pass here, after main_grad holds it. torch keeps them in this dict (torch/_tensor.py).
            for hook in (getattr(weight, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(weight)
            self._held_bytes -= nbytes

    def pending(self) -> int:
        return len(self._queue)
