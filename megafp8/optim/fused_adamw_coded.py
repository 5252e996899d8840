"""The optimizer step as one Triton launch per bucket shard for the presets with coded storage (fp16 master weights,
bf16 or FP8 moments, in any combination), bit-identical to its torch twin, megafp8.optim.storage_update (the slab
path). fp32 master with fp32 moments has its own kernel: megafp8.optim.fused_adamw, whose docstring says why these
kernels live here and how the AdamW arithmetic matches torch's.

One program takes ``ROWS`` whole 128-element groups, so every per-group quantity is computed in registers: an FP8
moment is decoded with its group's amax and k, updated, and encoded again with the new group's amax, amin and k
(megafp8.optim.state_codec; the powers in fp64 through megafp8.optim.reproducible_math, as the codec does); the fp16
master is decoded with its tensor's power-of-two scale and written back stochastically rounded with the twin's
counter-based bits (megafp8_kernels.counter_hash: ``hash(key of (seed, step, parameter), flat index in the
parameter)``, the same 32-bit integer hash in int64 here), and each group's largest |new value| goes to a per-group
table the optimizer reduces per tensor once. The clip factor, the finite flag, the step size and
``sqrt(1 - beta2^t)`` are 0-dim device tensors; where ``finite`` is False nothing is stored.

After the step (and the fp16 scales' update) ``publish_fp16_master_triton`` writes the fp16 master's values into the
model's high-precision weights, one launch per bucket shard, as the slab path's decode and copy do.

Rounding matches the twin's conversions exactly: fp32 -> E4M3 and fp32 -> bf16 are done with integer arithmetic
(round to nearest even; the interpreter's own float8 cast drops the carry into the exponent), fp32 -> fp16 is
Triton's round-to-nearest cast. The launch disables FMA contraction: the twin rounds every product. The kernels are in
fused_adamw_coded_triton.py, imported at the first launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megafp8.optim import reproducible_math
from megafp8.optim.fused_adamw import GPU_BLOCK, INTERPRETER_BLOCK, cdiv
from megafp8.optim.state_codec import GROUP, Fp8ExpandCodec, PlainCodec, StateCodec, fp8_code_table
from megafp8.optim.storage_update import Fp16Master


STATE_FP32, STATE_BF16, STATE_FP8 = 0, 1, 2
# Groups per program: on a GPU 4 (512 elements, 4 warps: the fp64 codec math is register-hungry); under the
# interpreter (one Python iteration per program) 512.
GPU_ROWS, INTERPRETER_ROWS = 4, 512


@dataclass(frozen=True)
class CodedStorage:
    """The storage as the kernel reads it, its views made once (views made per launch would cost ops per bucket):
    the master (fp32 values or fp16 codes) and per moment (values, amax bits, k bits): fp32 values, bf16 values as
    int16 bits, or FP8 codes as bytes with their per-group bf16 amax and k as int16 bits."""

    master: torch.Tensor
    fp16_master: bool
    state: int
    exp_avg: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def coded_storage(master: PlainCodec, exp_avg: StateCodec, exp_avg_sq: StateCodec) -> CodedStorage:
    def views(codec: StateCodec):
        if isinstance(codec, Fp8ExpandCodec):
            return codec.codes.view(torch.uint8), codec.amax.view(torch.int16), codec.k.view(torch.int16)
        values = codec.values.view(torch.int16) if codec.values.dtype == torch.bfloat16 else codec.values
        return values, values, values  # amax and k unused

    state = {"fp32": STATE_FP32, "bf16": STATE_BF16, "fp8": STATE_FP8}[exp_avg.name]
    return CodedStorage(master.values, master.values.dtype == torch.float16, state, views(exp_avg), views(exp_avg_sq))


def adamw_coded_triton(grads: torch.Tensor, grad_lo: int, start: int, n: int, storage: CodedStorage, *,
                       group_decay: torch.Tensor | None, decay_factor: float, clip: torch.Tensor | None,
                       finite: torch.Tensor, step_size: torch.Tensor, bias_correction2_sqrt: torch.Tensor,
                       beta1: float, beta2: float, eps: float, fp16: Fp16Master | None) -> None:
    """``storage_update.adamw_update`` on storage ``[start, start + n)`` (whole groups), reading the grads at
    ``[grad_lo, grad_lo + n)`` of a bucket's grad buffer, in one launch; one learning rate (a 0-dim step size, a
    float decay factor: the optimizer launches once per same-LR run)."""
    assert n % GROUP == 0 and start % GROUP == 0, "the kernel takes whole groups"
    assert storage.fp16_master == (fp16 is not None)
    device = grads.device
    rows = GPU_ROWS if device.type == "cuda" else INTERPRETER_ROWS
    weight = 1 - beta1
    unused = finite
    (m, m_amax, m_k), (v, v_amax, v_k) = storage.exp_avg, storage.exp_avg_sq
    tables = (fp16.scale, fp16.keys, fp16.index_offset, fp16.group_amax) if fp16 is not None else (unused,) * 4
    from megafp8.optim import fused_adamw_coded_triton  # Triton is imported only where it is used

    fused_adamw_coded_triton._adamw_coded_kernel[(cdiv(n // GROUP, rows),)](
        grads, grad_lo, start, n // GROUP, storage.master, m, m_amax, m_k, v, v_amax, v_k,
        unused if group_decay is None else group_decay, unused if clip is None else clip, finite, step_size,
        bias_correction2_sqrt, *tables, reproducible_math.constants(device), fp8_code_table(device),
        decay_factor, weight, beta2, 1 - beta2, eps,
        FP16_MASTER=storage.fp16_master, STATE=storage.state, HAS_DECAY=group_decay is not None,
        HAS_CLIP=clip is not None, SMALL_WEIGHT=abs(weight) < 0.5, ROWS=rows, GROUP_SIZE=GROUP,
        num_warps=4, enable_fp_fusion=False)


def publish_fp16_master_triton(codes: torch.Tensor, scale_of_group: torch.Tensor, group_lo: int,
                               out: torch.Tensor) -> None:
    """``out.copy_(codes.float() / scale)``, in one launch: a bucket shard's fp16 master codes (their groups' scales
    from ``scale_of_group[group_lo:]``) published into its ``param_data`` view, rounded to ``out``'s dtype as torch's
    copy rounds (what the slab path's decode and copy write)."""
    block = GPU_BLOCK if out.device.type == "cuda" else INTERPRETER_BLOCK
    from megafp8.optim import fused_adamw_coded_triton

    fused_adamw_coded_triton._publish_fp16_master_kernel[(cdiv(out.numel(), block),)](
        codes, scale_of_group, group_lo, out, out.numel(), OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block,
        GROUP_SIZE=GROUP, enable_fp_fusion=False)
