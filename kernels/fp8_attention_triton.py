"""Triton FP8 flash attention, forward: FP8 Q·Kᵀ and P·V on the tensor cores, softmax statistics in fp32.

Twin: fp8_attention_reference.fp8_attention_forward (same signature and rules; the fp32 sums run in another order,
so an exp that lands an ulp apart may flip a rare P cast). One program per (BLOCK_M query rows, batch x query head)
reads its K/V head (head // (H / G): GQA without copies) in two passes over the keys: the first finds each row's
exact log-sum-exp (running max and sum, the online softmax), the second casts P = exp(S - lse) with the fixed
scale P_SCALE to E4M3 and accumulates P8 · V8. P is then normalised before its cast, as the twin's, instead of
rescaling an accumulator built from P's of different maxima (whose bytes would depend on the key tiling); the
price is Q·Kᵀ twice. A causal program stops at its last row's key. The backward runs in the twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_attention_reference import P_SCALE
from .quantize_triton import _interpreting, _round_to_fp8_grid

BLOCK_M, BLOCK_N = 64, 64
WARPS = 4


@triton.jit
def _fp8_attention_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, factor_ptr, v_factor_ptr,
                                  heads, heads_per_group, sq, sk,
                                  stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                                  stride_ob, stride_oh, stride_os,
                                  CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, P_MAX: tl.constexpr,
                                  BM: tl.constexpr, BN: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // heads, pid_bh % heads
    group = head // heads_per_group
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qs + cols[None, :],
                mask=rows[:, None] < sq, other=0.0)
    k_base = k_ptr + batch * stride_kb + group * stride_kh
    v_base = v_ptr + batch * stride_kb + group * stride_kh
    factor = tl.load(factor_ptr)  # q_inv * k_inv * softmax_scale
    # Keys past the last row never count under the causal mask (square blocks: query i sees keys 0..i).
    hi = tl.minimum(sk, (pid_m + 1) * BM) if CAUSAL else sk

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    for start in range(0, hi, BN):  # pass 1: each row's log-sum-exp
        s = _scores(q, k_base, start, rows, sk, stride_ks, factor, CAUSAL, HEAD_DIM, BN)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (rows past sq) stays empty
        l_i = l_i * tl.exp((m_i - m_safe)) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m_i = m_new
    lse = m_i + tl.log(l_i)

    acc = tl.zeros([BM, HEAD_DIM], tl.float32)
    for start in range(0, hi, BN):  # pass 2: P8 = E4M3(exp(S - lse) * P_MAX), acc += P8 · V8
        s = _scores(q, k_base, start, rows, sk, stride_ks, factor, CAUSAL, HEAD_DIM, BN)
        p = tl.exp(s - lse[:, None]) * P_MAX  # in [0, P_MAX]: no saturation to handle
        if SOFTWARE_ROUNDING:  # the interpreter's fp32 -> fp8 conversion drops the carry (quantize_triton.py)
            p = _round_to_fp8_grid(p, 3, -6)
        p8 = p.to(tl.float8e4nv)
        keys = start + tl.arange(0, BN)
        v = tl.load(v_base + keys[:, None] * stride_ks + cols[None, :], mask=keys[:, None] < sk, other=0.0)
        acc = tl.dot(p8, v, acc)
    out = acc * tl.load(v_factor_ptr)  # v_inv / P_MAX
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + cols[None, :], out,
             mask=rows[:, None] < sq)
    tl.store(lse_ptr + pid_bh * sq + rows, lse, mask=rows < sq)


@triton.jit
def _scores(q, k_base, start, rows, sk, stride_ks, factor, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BN: tl.constexpr):
    """S = (Q8 · K8ᵀ) * factor for keys [start, start + BN), -inf where masked (past sk, or causal)."""
    keys = start + tl.arange(0, BN)
    k = tl.load(k_base + keys[:, None] * stride_ks + tl.arange(0, HEAD_DIM)[None, :], mask=keys[:, None] < sk,
                other=0.0)
    s = tl.dot(q, tl.trans(k)) * factor
    visible = keys[None, :] < sk
    if CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    return tl.where(visible, s, float("-inf"))


def fp8_attention_forward_triton(q8, k8, v8, q_inv, k_inv, v_inv, causal: bool, softmax_scale: float):
    """The twin's fp8_attention_forward on a Triton kernel: (out fp32 ``[b, H, sq, d]``, lse fp32 ``[b, H, sq]``)."""
    b, heads, sq, d = q8.shape
    groups, sk = k8.shape[1], k8.shape[2]
    if causal and sq != sk:
        raise ValueError(f"fp8 attention: a causal block is square, got {sq} queries x {sk} keys")
    if d < 16 or d & (d - 1):
        raise ValueError(f"fp8 attention: the Triton kernel takes a power-of-two head dim >= 16, got {d}")
    q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
    out = torch.empty((b, heads, sq, d), dtype=torch.float32, device=q8.device)
    lse = torch.empty((b, heads, sq), dtype=torch.float32, device=q8.device)
    factor = (q_inv * k_inv * softmax_scale).reshape(1).float()
    v_factor = (v_inv / P_SCALE).reshape(1).float()
    grid = (triton.cdiv(sq, BLOCK_M), b * heads)
    _fp8_attention_forward_kernel[grid](
        q8, k8, v8, out, lse, factor, v_factor, heads, heads // groups, sq, sk,
        q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=causal, HEAD_DIM=d, P_MAX=P_SCALE, BM=BLOCK_M, BN=BLOCK_N, SOFTWARE_ROUNDING=_interpreting(),
        num_warps=WARPS)
    return out, lse
