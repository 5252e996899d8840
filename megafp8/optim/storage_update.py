"""One AdamW update over a group-aligned range of the optimizer's flat storage, for every preset (fp32 or fp16 master
weights; fp32, bf16 or FP8 moments): what the step's slab path runs, and the torch twin the fused kernels
(megafp8.optim.fused_adamw, megafp8.optim.fused_adamw_coded) equal bit for bit.

torch.optim.AdamW's single-tensor, non-capturable rule in its operation order, out of place, with the clip factor,
the finite flag, the step size and ``sqrt(1 - beta2^t)`` as device tensors: where ``finite`` is False every stored
value is kept (``keep=finite``), so a skipped step never asks the host.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megafp8.optim.fused_adamw import sqrt_rn
from megafp8.optim.state_codec import GROUP, PlainCodec, StateCodec
from megafp8.optim.stochastic_rounding import counter_uniform_at, stochastic_round_to_fp16


@dataclass
class Fp16Master:
    """One step's per-group tables of the fp16 master (codes = value * scale): the scale, the stochastic rounding's
    key, the offset from storage index to the element's flat index in its parameter, and ``group_amax``, which the
    update fills with each group's largest |new value| (what the power-of-two scales follow)."""

    scale: torch.Tensor         # fp32
    keys: torch.Tensor          # int64
    index_offset: torch.Tensor  # int64
    group_amax: torch.Tensor    # fp32, written


def adamw_update(grads: Sequence[torch.Tensor], start: int, n: int, master: PlainCodec, exp_avg: StateCodec,
                 exp_avg_sq: StateCodec, *, group_decay: torch.Tensor | None, decay_factor: float | torch.Tensor,
                 clip: torch.Tensor | None, finite: torch.Tensor, step_size: torch.Tensor,
                 bias_correction2_sqrt: torch.Tensor, beta1: float, beta2: float, eps: float,
                 fp16: Fp16Master | None) -> None:
    """AdamW on storage ``[start, start + n)``; ``grads``: its grads in pieces (views of the grad buffers, concatenated
    here, so their fp32 copy is freed as soon as it is used). ``group_decay`` (bool per storage group; None: no decay)
    selects ``decay_factor``; ``decay_factor`` and ``step_size`` are one value or one per storage group (two learning
    rates); ``fp16`` is given for an fp16 master."""
    groups = slice(start // GROUP, (start + n) // GROUP)
    g = (grads[0] if len(grads) == 1 else torch.cat(list(grads))).float()
    if clip is not None:
        g = g * clip
    p = master.decode(start, start + n).view(-1, GROUP)
    if fp16 is not None:
        p = p / fp16.scale[groups, None]
    m, v = exp_avg.decode(start, start + n), exp_avg_sq.decode(start, start + n)
    if group_decay is not None:
        factor = decay_factor[groups, None] if isinstance(decay_factor, torch.Tensor) else decay_factor
        p = p * torch.where(group_decay[groups, None], factor, 1.0)
    p = p.reshape(-1)
    m = torch.lerp(m, g, 1 - beta1)
    v = (v * beta2).addcmul_(g, g, value=1 - beta2)
    del g  # every temporary goes as soon as it is used: the step's peak is a few slab-sized tensors
    denom = (sqrt_rn(v) / bias_correction2_sqrt).add_(eps)  # IEEE sqrt, as on CUDA
    update = m.view(-1, GROUP).mul(step_size[groups, None]).view(-1) if step_size.dim() else m.mul(step_size)
    p = p + update.div_(denom)  # addcdiv's (value * m) / denom; p may alias the fp32 master
    del update, denom
    exp_avg.encode(start, start + n, m, keep=finite)
    exp_avg_sq.encode(start, start + n, v, keep=finite)
    del m, v  # before the rounding's hash temporaries
    if fp16 is None:
        master.encode(start, start + n, p, keep=finite)
        return
    index = torch.arange(start, start + n, device=p.device).view(-1, GROUP) + fp16.index_offset[groups, None]
    uniform = counter_uniform_at(fp16.keys[groups, None], index)
    del index
    codes = p.view(-1, GROUP) * fp16.scale[groups, None]
    master.encode(start, start + n, stochastic_round_to_fp16(codes, uniform).view(-1), keep=finite)
    del codes, uniform
    fp16.group_amax[groups] = p.abs().view(-1, GROUP).amax(dim=1)
