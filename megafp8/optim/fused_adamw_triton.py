"""The Triton kernels of megafp8.optim.fused_adamw (beside their twins and launchers there), imported at the first
fused step rather than at every process's start."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _grad_group_squares_kernel(g_ptr, grad_lo, out_ptr, group_lo, n_groups, ROWS: tl.constexpr,
                               GROUP_SIZE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, GROUP_SIZE)
    inside = rows < n_groups
    g = tl.load(g_ptr + grad_lo + rows[:, None] * GROUP_SIZE + cols[None, :], mask=inside[:, None], other=0.0)
    g = g.to(tl.float32).to(tl.float64)
    x = g * g  # the twin's tree (GROUP_SIZE = 128): element k of one half plus element k of the other, 7 levels
    x = tl.sum(tl.reshape(x, (ROWS, 2, 64)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 32)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 16)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 8)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 4)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (ROWS, 2, 1)), axis=1)
    tl.store(out_ptr + group_lo + rows, tl.reshape(x, (ROWS,)), mask=inside)

@triton.jit
def _adamw_fp32_kernel(g_ptr, grad_lo, p_ptr, m_ptr, v_ptr, start, n, decay_ptr, clip_ptr, finite_ptr,
                       step_size_ptr, bc2_ptr, decay_factor, lerp_weight, beta2, one_minus_beta2, eps,
                       HAS_DECAY: tl.constexpr, HAS_CLIP: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                       BLOCK: tl.constexpr, GROUP_SIZE: tl.constexpr):
    local = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = local < n
    offs = start + local
    g = tl.load(g_ptr + grad_lo + local, mask=inside, other=0.0).to(tl.float32)
    if HAS_CLIP:
        g = g * tl.load(clip_ptr)
    p = tl.load(p_ptr + offs, mask=inside, other=0.0)
    m = tl.load(m_ptr + offs, mask=inside, other=0.0)
    v = tl.load(v_ptr + offs, mask=inside, other=0.0)
    new_p = p
    if HAS_DECAY:
        decays = tl.load(decay_ptr + offs // GROUP_SIZE, mask=inside, other=0) != 0
        new_p = p * tl.where(decays, decay_factor, 1.0)
    diff = g - m
    if SMALL_WEIGHT:  # torch's lerp: fma(w, end - self, self) for |w| < 0.5, else fma(w - 1, end - self, end)
        new_m = tl.fma(diff, lerp_weight, m)
    else:
        new_m = tl.fma(diff, lerp_weight - 1.0, g)
    new_v = tl.fma(g * one_minus_beta2, g, v * beta2)
    denom = tl.math.div_rn(tl.math.sqrt_rn(new_v), tl.load(bc2_ptr)) + eps
    new_p = new_p + tl.math.div_rn(new_m * tl.load(step_size_ptr), denom)
    finite = tl.load(finite_ptr) != 0
    tl.store(m_ptr + offs, tl.where(finite, new_m, m), mask=inside)
    tl.store(v_ptr + offs, tl.where(finite, new_v, v), mask=inside)
    tl.store(p_ptr + offs, tl.where(finite, new_p, p), mask=inside)
