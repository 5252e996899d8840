"""Triton FP8 flash attention: FP8 Q·Kᵀ and P·V and the backward GEMMs on the tensor cores, softmax in fp32.

Twin: fp8_attention_reference.fp8_attention_forward (same signature and rules; the fp32 sums run in another order,
so an exp that lands an ulp apart may flip a rare P cast). One program per (BLOCK_M query rows, batch x query head)
reads its K/V head (head // (H / G): GQA without copies) in two passes over the keys: the first finds each row's
exact log-sum-exp (running max and sum, the online softmax), the second casts P = exp(S - lse) with the fixed
scale P_SCALE to E4M3 and accumulates P8 · V8. P is then normalised before its cast, as the twin's, instead of
rescaling an accumulator built from P's of different maxima (whose bytes would depend on the key tiling); the
price is Q·Kᵀ twice. A causal program stops at its last row's key.

Backward (FlashAttention-2's split): one program per (BLOCK_N keys, batch x K/V head) walks its query heads and
query blocks for dK and dV, one per (BLOCK_M query rows, batch x query head) walks the keys for dQ; both recompute
P from the forward's lse and dS from the given delta. dS's current scale is per 64 x 64 tile (the twin's DS_TILE):
its amax is in registers, and both programs derive the same scale from the same values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_attention_reference import P_SCALE
from .fp8_attention_reference import DS_TILE
from .quantize_triton import (_interpreting, _reciprocal, _round_to_fp8_grid, _scale_from_amax, to_fp8_bits,
                              triton_fp8_dtype)

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


@triton.jit
def _recompute_ds(q, do, k, v, lse, delta, rows, keys, sq, sk, factor, dp_factor,
                  CAUSAL: tl.constexpr, P_MAX: tl.constexpr, DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr,
                  DS_MBITS: tl.constexpr, DS_EMIN: tl.constexpr, POW2: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """(P8, dS8, dS's scale_inv) of one query block x key block, exactly as the twin: P from the lse,
    dS = P (dP - delta) with dP = dO8 · V8ᵀ, dS cast with the current scale of this tile."""
    s = tl.dot(q, tl.trans(k)) * factor
    visible = (rows[:, None] < sq) & (keys[None, :] < sk)
    if CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
    p_scaled = p * P_MAX
    if SOFTWARE_ROUNDING:
        p_scaled = _round_to_fp8_grid(p_scaled, 3, -6)
    p8 = p_scaled.to(tl.float8e4nv)
    dp = tl.dot(do, tl.trans(v)) * dp_factor
    ds = p * (dp - delta[:, None])
    scale = _scale_from_amax(tl.max(tl.max(tl.abs(ds), axis=1), axis=0), DS_MAX, POW2)
    ds8 = to_fp8_bits(ds * scale, DS_DTYPE, DS_MAX, DS_MBITS, DS_EMIN, SOFTWARE_ROUNDING).to(DS_DTYPE, bitcast=True)
    return p8, ds8, _reciprocal(scale)


@triton.jit
def _fp8_attention_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, factors_ptr,
                               heads, heads_per_group, groups, sq, sk,
                               stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, P_MAX: tl.constexpr,
                               DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr, DS_MBITS: tl.constexpr,
                               DS_EMIN: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               SOFTWARE_ROUNDING: tl.constexpr):
    pid_n, pid_bg = tl.program_id(0), tl.program_id(1)
    batch, group = pid_bg // groups, pid_bg % groups
    keys = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, HEAD_DIM)
    kv_offsets = batch * stride_kb + group * stride_kh + keys[:, None] * stride_ks + cols[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=keys[:, None] < sk, other=0.0)
    v = tl.load(v_ptr + kv_offsets, mask=keys[:, None] < sk, other=0.0)
    factor, dp_factor = tl.load(factors_ptr), tl.load(factors_ptr + 1)
    dk = tl.zeros([BN, HEAD_DIM], tl.float32)
    dv = tl.zeros([BN, HEAD_DIM], tl.float32)
    lo = pid_n * BN if CAUSAL else 0  # causal: query rows before the first key see none of these keys
    for head in range(group * heads_per_group, (group + 1) * heads_per_group):
        q_base = batch * stride_qb + head * stride_qh
        for start in range(lo - lo % BM, sq, BM):
            rows = start + tl.arange(0, BM)
            row_offsets = q_base + rows[:, None] * stride_qs + cols[None, :]
            q = tl.load(q_ptr + row_offsets, mask=rows[:, None] < sq, other=0.0)
            do = tl.load(do_ptr + row_offsets, mask=rows[:, None] < sq, other=0.0)
            lse = tl.load(lse_ptr + (batch * heads + head) * sq + rows, mask=rows < sq, other=0.0)
            delta = tl.load(delta_ptr + (batch * heads + head) * sq + rows, mask=rows < sq, other=0.0)
            p8, ds8, ds_inv = _recompute_ds(q, do, k, v, lse, delta, rows, keys, sq, sk, factor, dp_factor, CAUSAL,
                                            P_MAX, DS_DTYPE, DS_MAX, DS_MBITS, DS_EMIN, POW2, SOFTWARE_ROUNDING)
            dv = tl.dot(tl.trans(p8), do, dv)
            dk += tl.dot(tl.trans(ds8), q) * ds_inv
    out_offsets = (batch * groups + group) * sk * HEAD_DIM + keys[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dk_ptr + out_offsets, dk * tl.load(factors_ptr + 2), mask=keys[:, None] < sk)
    tl.store(dv_ptr + out_offsets, dv * tl.load(factors_ptr + 3), mask=keys[:, None] < sk)


@triton.jit
def _fp8_attention_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, factors_ptr,
                             heads, heads_per_group, sq, sk,
                             stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                             CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, P_MAX: tl.constexpr,
                             DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr, DS_MBITS: tl.constexpr,
                             DS_EMIN: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             SOFTWARE_ROUNDING: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // heads, pid_bh % heads
    group = head // heads_per_group
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, HEAD_DIM)
    row_offsets = batch * stride_qb + head * stride_qh + rows[:, None] * stride_qs + cols[None, :]
    q = tl.load(q_ptr + row_offsets, mask=rows[:, None] < sq, other=0.0)
    do = tl.load(do_ptr + row_offsets, mask=rows[:, None] < sq, other=0.0)
    lse = tl.load(lse_ptr + pid_bh * sq + rows, mask=rows < sq, other=0.0)
    delta = tl.load(delta_ptr + pid_bh * sq + rows, mask=rows < sq, other=0.0)
    factor, dp_factor = tl.load(factors_ptr), tl.load(factors_ptr + 1)
    kv_base = batch * stride_kb + group * stride_kh
    dq = tl.zeros([BM, HEAD_DIM], tl.float32)
    hi = tl.minimum(sk, (pid_m + 1) * BM) if CAUSAL else sk
    for start in range(0, hi, BN):
        keys = start + tl.arange(0, BN)
        kv_offsets = kv_base + keys[:, None] * stride_ks + cols[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=keys[:, None] < sk, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=keys[:, None] < sk, other=0.0)
        _, ds8, ds_inv = _recompute_ds(q, do, k, v, lse, delta, rows, keys, sq, sk, factor, dp_factor, CAUSAL,
                                       P_MAX, DS_DTYPE, DS_MAX, DS_MBITS, DS_EMIN, POW2, SOFTWARE_ROUNDING)
        dq += tl.dot(ds8, k) * ds_inv
    out_offsets = pid_bh * sq * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dq_ptr + out_offsets, dq * tl.load(factors_ptr + 4), mask=rows[:, None] < sq)


def fp8_attention_backward_triton(do8, q8, k8, v8, do_inv, q_inv, k_inv, v_inv, lse, delta, causal: bool,
                                  softmax_scale: float, ds_format, power_of_2_scale: bool = False):
    """The twin's fp8_attention_backward on two Triton kernels: (dq ``[b, H, sq, d]``, dk, dv ``[b, G, sk, d]``),
    all fp32."""
    b, heads, sq, d = q8.shape
    groups, sk = k8.shape[1], k8.shape[2]
    if causal and sq != sk:
        raise ValueError(f"fp8 attention: a causal block is square, got {sq} queries x {sk} keys")
    if BLOCK_M != DS_TILE or BLOCK_N != DS_TILE:
        raise ValueError(f"fp8 attention: dS's scale tile ({DS_TILE}) must be the kernel's block")
    q8, k8, v8, do8 = (t.contiguous() for t in (q8, k8, v8, do8))
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    fmt = ds_format
    # factors: S's, dP's, dK's (q_inv * softmax_scale), dV's (do_inv / P_SCALE), dQ's (k_inv * softmax_scale)
    factors = torch.stack([q_inv * k_inv * softmax_scale, do_inv * v_inv, q_inv * softmax_scale, do_inv / P_SCALE,
                           k_inv * softmax_scale]).float().reshape(5)
    dq = torch.empty((b, heads, sq, d), dtype=torch.float32, device=q8.device)
    dk = torch.empty((b, groups, sk, d), dtype=torch.float32, device=q8.device)
    dv = torch.empty_like(dk)
    common = dict(CAUSAL=causal, HEAD_DIM=d, P_MAX=P_SCALE, DS_DTYPE=triton_fp8_dtype(fmt.dtype), DS_MAX=fmt.max,
                  DS_MBITS=fmt.mantissa_bits, DS_EMIN=fmt.min_normal_exponent, POW2=power_of_2_scale, BM=BLOCK_M,
                  BN=BLOCK_N, SOFTWARE_ROUNDING=_interpreting(), num_warps=WARPS)
    strides = (q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2))
    _fp8_attention_dkdv_kernel[(triton.cdiv(sk, BLOCK_N), b * groups)](
        q8, k8, v8, do8, lse, delta, dk, dv, factors, heads, heads // groups, groups, sq, sk, *strides, **common)
    _fp8_attention_dq_kernel[(triton.cdiv(sq, BLOCK_M), b * heads)](
        q8, k8, v8, do8, lse, delta, dq, factors, heads, heads // groups, sq, sk, *strides, **common)
    return dq, dk, dv
