"""Activation recomputation (Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers):
which parts of a stage re-run their forward in backward instead of keeping their activations.

- ``full`` + ``uniform``: the stage's layers in groups of ``recompute_num_layers``; only each group's
  input is kept. ``full`` + ``block``: the first ``recompute_num_layers`` layers of each stage (chunk)
  are recomputed one by one, the rest keep their activations.
- ``selective``: only the attention core (rotary + ``scaled_dot_product_attention``, whose math kernel
  saves the ``[b, heads, s, s]`` probabilities) is recomputed, in every layer.

Recomputation must not change a single bit. Built on non-reentrant ``torch.utils.checkpoint``:

- RNG: the CPU and CUDA generator states are restored for the recomputed forward, and so are the
  model-parallel RNG's tracked states (``ModelParallelRNG``) when the model carries one.
- FP8: delayed scales only change in ``Fp8ScalingManager.update()`` (once per step, after backward) and
  the FP8 weight is cached for the step, so the recomputed forward quantizes with the same scales and
  weight bytes; current scales (cold start, current-scaling recipes) are recomputed from bit-identical
  tensors. The recomputed forward re-observes the same amaxes, a no-op under the history's max, and
  the grad_output amax is observed once, by the single backward that runs: the delayed-scaling state
  after the step equals the one without recomputation (tests/test_pipeline_recompute.py checks both).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from megafp8.parallel.random import ModelParallelRNG

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def recompute_errors(granularity: str | None, method: str | None, num_layers: int | None) -> list[str]:
    """Every rule the recompute flags break, each naming its flag (Megatron's rules)."""
    if granularity is None:
        if method is not None or num_layers is not None:
            return ["--recompute-method / --recompute-num-layers need --recompute-granularity full"]
        return []
    if granularity not in GRANULARITIES:
        return [f"--recompute-granularity must be one of {'|'.join(GRANULARITIES)}, got {granularity!r}"]
    if granularity == "selective":
        if method is not None or num_layers is not None:
            return ["--recompute-method / --recompute-num-layers apply to --recompute-granularity full only "
                    "(selective recomputes the attention core of every layer)"]
        return []
    errors = []
    if method not in METHODS:
        errors.append(f"--recompute-granularity full needs --recompute-method {'|'.join(METHODS)}, got {method!r}")
    if num_layers is None or num_layers < 1:
        errors.append(f"--recompute-granularity full needs --recompute-num-layers >= 1, got {num_layers}")
    return errors


def recomputed_layer_groups(num_local_layers: int, method: str, num_layers: int) -> list[tuple[int, int, bool]]:
    """``(start, end, recompute)`` runs of a stage's local layers, in order."""
    if method == "uniform":
        return [(start, min(start + num_layers, num_local_layers), True)
                for start in range(0, num_local_layers, num_layers)]
    block = min(num_layers, num_local_layers)
    groups = [(i, i + 1, True) for i in range(block)]
    if block < num_local_layers:
        groups.append((block, num_local_layers, False))
    return groups


@contextlib.contextmanager
def _tracked_rng_states(rng: ModelParallelRNG, states: dict) -> Iterator[None]:
    """Run with ``rng``'s tracked states set to ``states`` (the forward's), then put the current ones back."""
    current = rng.state_dict()
    current.pop("default")  # the default generators are torch.utils.checkpoint's to restore
    rng.load_state_dict(states)
    try:
        yield
    finally:
        rng.load_state_dict(current)


class _KeepForRecompute(torch.autograd.Function):
    """Identity that saves the region's inputs for backward, as Megatron's CheckpointFunction does: torch's
    checkpoint keeps them alive anyway (its recompute closure holds them), but saving them here makes
    them visible to saved-tensor accounting (megafp8.parallel.pipeline_memory) at no extra memory."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        ctx.save_for_backward(*tensors)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def recompute(function: Callable[..., torch.Tensor], *args: torch.Tensor,
              rng: ModelParallelRNG | None = None) -> torch.Tensor:
    """``function(*args)``, keeping only ``args`` for backward and re-running ``function`` there with the
    RNG states (default generators and ``rng``'s tracked ones) the forward saw."""
    args = _KeepForRecompute.apply(*args)
    if rng is None:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    states = rng.state_dict()
    states.pop("default")

    def context_fn():
        return contextlib.nullcontext(), _tracked_rng_states(rng, states)

    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)
