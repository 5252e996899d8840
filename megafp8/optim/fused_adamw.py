"""The optimizer step as one Triton kernel launch per bucket shard (fp32 master weights and fp32 moments), beside
its torch twin with the same signature (the other presets: megafp8.optim.fused_adamw_coded).

The kernels are in fused_adamw_triton.py, imported at the first launch (not at every process's start).

Why here and not in ``kernels/``: the kernel speaks the optimizer's storage layout (flat shards, 128-element
groups with a per-group weight-decay table, the keep-on-non-finite rule), which ``kernels/`` must not know; its
arguments are still plain tensors and numbers (no process groups, no models).

Two kernels, each launched once per bucket shard (so a step costs ``2 x shards`` launches plus a fixed number of
torch ops, whatever the parameter count):

``grad_group_squares``  per 128-element group of the shard's grads, the fp64 sum of the squares (the grad norm's
                        first pass; the optimizer masks and sums the group table once, over the whole storage).
``adamw_fp32``          AdamW in place over ``[start, start + n)`` of the master / exp_avg / exp_avg_sq storage,
                        reading the grads at ``[grad_lo, grad_lo + n)`` of the bucket's grad buffer (fp32 or bf16).
                        The clip factor, the finite flag, the step size and ``sqrt(1 - beta2^t)`` are 0-dim device
                        tensors the kernel loads: nothing reads the host. Where ``finite`` is False every stored
                        value stays as it was.

Bits: the update is torch.optim.AdamW's single-tensor rule exactly as the slab path computes it on the CPU, where
torch's ``lerp`` and ``addcmul`` are fused multiply-adds (checked in tests/test_optim_fused_step.py)::

    g  = g * clip
    p  = p * (decay_factor where the group decays, else 1)
    m  = fma(w, g - m, m)                   torch.lerp(m, g, w), w = 1 - beta1 < 0.5 (else fma(w - 1, g - m, g))
    v  = fma((1 - beta2) * g, g, v * beta2)  (v * beta2).addcmul_(g, g, value=1 - beta2)
    d  = sqrt(v) / bias_correction2_sqrt + eps
    p  = p + (m * step_size) / d

with IEEE division and square root (``div_rn``, ``sqrt_rn``: Triton's ``/`` and ``sqrt`` may be approximate on a
GPU), launched with ``enable_fp_fusion=False``: the fmas are the ones written (``tl.fma``), the compiler may not
contract a product and a sum the twin rounds apart (``p * decay + update``, the squares' first tree level). torch's own fp32 ``sqrt`` on the CPU (AVX512 build) is within an ulp but not correctly rounded (0.6% of
random inputs differ from IEEE), so the twins take the square root through fp64 (``sqrt_rn``: correctly rounded,
53 >= 2 x 24 + 2 bits), which is what CUDA's ``sqrtf`` and Triton's ``sqrt_rn`` give.

The grad norm's per-group sums of squares are summed as a fixed binary tree (halves added, 7 levels), in the
kernel and in the twins: a reduction of two values is exact whatever the order, so the norm is bit-identical on
both paths (torch's own ``sum`` order depends on the CPU's vector width).
"""
from __future__ import annotations

import importlib.util

import torch

from megafp8.optim.state_codec import GROUP

AVAILABLE = importlib.util.find_spec("triton") is not None  # the kernels are imported at the first launch

# Elements per program: a GPU block, or (under the interpreter, one Python iteration per program) a large one.
GPU_BLOCK, INTERPRETER_BLOCK = 1024, 1 << 16
LAUNCHES_PER_SHARD = 2


def _block(device: torch.device) -> int:
    return GPU_BLOCK if device.type == "cuda" else INTERPRETER_BLOCK


def cdiv(a: int, b: int) -> int:
    """Launch grids: ceil(a / b) without importing Triton (triton.cdiv)."""
    return -(-a // b)


# ---- torch twins ---------------------------------------------------------------------------------
def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (torch's CPU ``sqrt`` is only faithful): through fp64."""
    return x.double().sqrt_().float()


def group_square_sums(g: torch.Tensor) -> torch.Tensor:
    """fp64 sums of squares per 128-element group of ``g``, added as a binary tree of halves (order-free bits)."""
    x = g.double().square().view(-1, 2, GROUP // 2)
    while x.shape[-1] > 1:
        x = x.sum(dim=1).view(x.shape[0], 2, -1)  # a reduction over two values: a + b, exactly
    return x.sum(dim=1).view(-1)


def grad_group_squares_torch(grads: torch.Tensor, grad_lo: int, out: torch.Tensor, group_lo: int, n: int) -> None:
    """``out[group_lo + j] = sum(grads[grad_lo + 128 j + i] ** 2 for i < 128)`` in fp64, for the ``n / 128`` groups."""
    out[group_lo:group_lo + n // GROUP].copy_(group_square_sums(grads[grad_lo:grad_lo + n].float()))


def adamw_fp32_torch(grads: torch.Tensor, grad_lo: int, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, start: int, n: int, group_decay: torch.Tensor | None,
                     clip: torch.Tensor | None, finite: torch.Tensor, step_size: torch.Tensor,
                     bias_correction2_sqrt: torch.Tensor, decay_factor: float, beta1: float, beta2: float,
                     eps: float) -> None:
    """AdamW in place on ``[start, start + n)`` of the fp32 storage (the slab path's operations, on plain tensors);
    ``group_decay`` (bool per storage group, None = no decay) selects ``decay_factor``; kept where not ``finite``."""
    g = grads[grad_lo:grad_lo + n].float()
    if clip is not None:
        g = g * clip
    p, m, v = master[start:start + n], exp_avg[start:start + n], exp_avg_sq[start:start + n]
    new_p = p
    if group_decay is not None:
        groups = group_decay[start // GROUP:(start + n) // GROUP, None]
        new_p = (p.view(-1, GROUP) * torch.where(groups, decay_factor, 1.0)).view(-1)
    new_m = torch.lerp(m, g, 1 - beta1)
    new_v = (v * beta2).addcmul_(g, g, value=1 - beta2)
    denom = (sqrt_rn(new_v) / bias_correction2_sqrt).add_(eps)
    new_p = new_p + new_m.mul(step_size).div_(denom)
    for stored, new in ((m, new_m), (v, new_v), (p, new_p)):
        stored.copy_(torch.where(finite, new, stored))


def grad_group_squares_triton(grads: torch.Tensor, grad_lo: int, out: torch.Tensor, group_lo: int, n: int) -> None:
    """``grad_group_squares_torch`` in one launch."""
    assert GROUP == 128, "the kernel's tree is written out for 128-element groups"
    rows = _block(grads.device) // GROUP
    groups = n // GROUP
    from megafp8.optim import fused_adamw_triton  # Triton is imported only where it is used

    fused_adamw_triton._grad_group_squares_kernel[(cdiv(groups, rows),)](
        grads, grad_lo, out, group_lo, groups, ROWS=rows, GROUP_SIZE=GROUP, enable_fp_fusion=False)


def adamw_fp32_triton(grads: torch.Tensor, grad_lo: int, master: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, start: int, n: int, group_decay: torch.Tensor | None,
                      clip: torch.Tensor | None, finite: torch.Tensor, step_size: torch.Tensor,
                      bias_correction2_sqrt: torch.Tensor, decay_factor: float, beta1: float, beta2: float,
                      eps: float) -> None:
    """``adamw_fp32_torch`` in one launch."""
    block = _block(master.device)
    weight = 1 - beta1
    from megafp8.optim import fused_adamw_triton

    fused_adamw_triton._adamw_fp32_kernel[(cdiv(n, block),)](
        grads, grad_lo, master, exp_avg, exp_avg_sq, start, n,
        finite if group_decay is None else group_decay, finite if clip is None else clip, finite, step_size,
        bias_correction2_sqrt, decay_factor, weight, beta2, 1 - beta2, eps,
        HAS_DECAY=group_decay is not None, HAS_CLIP=clip is not None, SMALL_WEIGHT=abs(weight) < 0.5,
        BLOCK=block, GROUP_SIZE=GROUP, enable_fp_fusion=False)
