"""Megatron's dropout placement and the generator each mask is drawn from: attention-probability dropout inside
core attention, and hidden dropout on a sublayer's output before its residual add (bias-dropout-add, no bias).

A mask must be identical on the TP ranks that hold the same activation and distinct where they hold different
ones. The residual stream is replicated over TP, so hidden dropout draws from the default generator, which every
TP rank seeds alike; under sequence parallelism each rank holds other tokens of it, and the attention probabilities
are always split by head, so those masks come from the model-parallel stream (``ModelParallelRNG.fork()``), which
differs per TP rank. Masks are drawn in training mode only (``module.training``; ``model.eval()`` turns them off),
and recomputation replays them: it restores the default generators and the tracker's states
(megafp8.model.recompute).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.nn.functional as F

from megafp8.parallel.random import ModelParallelRNG


def mask_generator(rng: ModelParallelRNG | None, per_tp_rank: bool, tp_size: int) -> ContextManager:
    """The generator region a mask is drawn in: ``rng``'s TP-rank stream when the TP ranks hold different
    activations (``per_tp_rank``), else the default generators (identical across TP ranks)."""
    if not per_tp_rank:
        return contextlib.nullcontext()
    if rng is None:
        if tp_size == 1:  # one rank: the default generator is as good as a rank's own stream
            return contextlib.nullcontext()
        raise ValueError("dropout on activations that differ between tensor-parallel ranks needs the model-parallel "
                         "RNG (GPTModel builds one when the config has dropout; standalone layers take rng=)")
    return rng.fork()


def hidden_dropout_add(out: torch.Tensor, residual: torch.Tensor, p: float, training: bool,
                       rng: ModelParallelRNG | None, sequence_parallel: bool, tp_size: int) -> torch.Tensor:
    """``residual + dropout(out)``: Megatron's bias-dropout-add without a bias; exactly ``residual + out`` when
    off (p = 0 or eval mode)."""
    if not training or p == 0.0:
        return residual + out
    with mask_generator(rng, sequence_parallel and tp_size > 1, tp_size):
        return residual + F.dropout(out, p, training=True)
