"""Triton block-scaled GEMM on tl.dot_scaled for two microscaled QuantizedTensors (MXFP8, MXFP4, NVFP4): C = A @ B.T.

Twin: scaled_gemm.scaled_gemm_reference (both operands dequantized to fp32, one fp32 matmul). A (M, K) and B (N, K)
are read from their row-major copies, K-major as the tensor cores want them: FP8 bytes or E2M1 codes two per byte
(the even element in the low nibble, dot_scaled's packing), by TMA, and their scales by plain loads, one
(rows, BLOCK_K / group) tile per K step:
  MX (MX_1X32)         E8M0 bytes (uint8), one per 1x32: dot_scaled's native group-32 scales; any pair of E4M3,
                       E5M2 and E2M1 elements;
  NVFP4 (NVFP4_1X16,   E4M3 bytes, one per 1x16 (or per 16x16: each row reads its block row's scales): group-16
         NVFP4_16X16)  scales, E2M1 elements; the fp32 per-tensor decode scales multiply the accumulator once in
                       the epilogue (alpha = ga * gb, as cuBLAS's NVFP4 GEMM takes them).
On sm_100a dot_scaled compiles to tcgen05.mma ... block_scale (kind::mxf8f6f4, mxf4, mxf4nvf4); on sm_90a Triton
upcasts both operands to bf16 (exact while the scaled element stays in bf16's normal range: an FP8 element times a
power of two, or an E2M1 value times an E4M3 scale, fits bf16's 8 bits) and runs a bf16 wgmma: Hopper runs these
recipes emulated, for numerics studies only.
tools/bench/kernel_audit_blackwell.py compiles every offered config for both offline.

Numerics against the twin: each product of dequantized elements is exact in fp32 on every path, so the results
differ only by the order of the fp32 sums (and, NVFP4, by applying ga * gb once instead of per element). Triton's
interpreter decodes dot_scaled's E4M3 scale bytes as E8M0 (2^(byte - 127)): an NVFP4 GEMM is silently wrong there
(tests/test_microscaling_triton.py holds that as a known-behaviour test and runs the kernel with a corrected decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from .formats import E2M1, E4M3, E5M2, ScaleFormat
from .gemm import _tma_ready
from .quantize_triton import _interpreting
from .quantized_tensor import QuantizedTensor

BLOCK_SCALED_GEMM_KERNEL_NAME = "_block_scaled_gemm_kernel"
_DOT_FORMAT = {E4M3.name: "e4m3", E5M2.name: "e5m2", E2M1.name: "e2m1"}


@triton.jit
def _bf16_rne(x):
    # fp32 -> bf16, round to nearest even on the bits (NaN kept): the interpreter's own cast truncates (GPUs round)
    bits = x.to(tl.int32, bitcast=True)
    rounded = tl.where(x != x, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _block_scaled_gemm_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, ga_ptr, gb_ptr, M, N, K, stride_cm,
                              stride_sa, stride_sb, sa_cols, sb_cols,
                              A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr, GROUP_K: tl.constexpr,
                              SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, SCALE_E4M3: tl.constexpr,
                              HAS_ALPHA: tl.constexpr, SOFTWARE_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C = A @ B.T, grouped order (GROUP_M row blocks share each B column block in L2).
    BLOCK_K counts elements; an E2M1 operand's TMA block is BLOCK_K / 2 bytes wide. Scales (rows / S*_ROWS, K / GROUP_K)
    row-major, loaded per K step as (BLOCK, BLOCK_K / GROUP_K); out-of-range ones read as 1 (their data is 0)."""
    A_PACK: tl.constexpr = 2 if A_FORMAT == "e2m1" else 1
    B_PACK: tl.constexpr = 2 if B_FORMAT == "e2m1" else 1
    ONE: tl.constexpr = 0x38 if SCALE_E4M3 else 127
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * grid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    sa_row = (offs_m // SA_ROWS).to(tl.int64) * stride_sa  # a 16x16 layout: the block row's scales
    sb_row = (offs_n // SB_ROWS).to(tl.int64) * stride_sb

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k_step * (BLOCK_K // A_PACK)])
        b = b_desc.load([pid_n * BLOCK_N, k_step * (BLOCK_K // B_PACK)])
        groups = k_step * (BLOCK_K // GROUP_K) + tl.arange(0, BLOCK_K // GROUP_K)
        sa = tl.load(sa_ptr + sa_row[:, None] + groups[None, :], mask=m_ok[:, None] & (groups < sa_cols)[None, :],
                     other=ONE)
        sb = tl.load(sb_ptr + sb_row[:, None] + groups[None, :], mask=n_ok[:, None] & (groups < sb_cols)[None, :],
                     other=ONE)
        if SCALE_E4M3:
            sa = sa.to(tl.float8e4nv, bitcast=True)
            sb = sb.to(tl.float8e4nv, bitcast=True)
        acc = tl.dot_scaled(a, sa, A_FORMAT, b.T, sb, B_FORMAT, acc)

    if HAS_ALPHA:
        acc = acc * (tl.load(ga_ptr) * tl.load(gb_ptr))
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]  # int64: C may pass 2^31
    if SOFTWARE_BF16:
        out = _bf16_rne(acc)
    else:
        out = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


def _config(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_stages=stages,
                         num_warps=warps)


# Blackwell (sm_100a): the accumulator lives in tensor memory, not registers, so 128x128 at 4 warps fits; a stage is
# (BLOCK_M + BLOCK_N) * BLOCK_K * bits / 8 bytes of operands (32 KB for FP8 at BLOCK_K 128 and for FP4 at 256, 128 B
# of K per row: the TMA/swizzle sweet spot) plus the scale tiles. Resources: kernel_audit_blackwell.py (docs table).
# The defaults (the first of each list) are chosen by that reasoning, not by timing: no Blackwell GPU has run them.
MX8_CONFIGS = [_config(128, 128, 128, 4, 4), _config(128, 128, 128, 3, 8), _config(128, 256, 128, 3, 8)]
FP4_CONFIGS = [_config(128, 128, 256, 4, 4), _config(128, 128, 256, 3, 8), _config(128, 256, 256, 3, 8)]
# Hopper (and any GPU without tcgen05): dot_scaled upcasts to bf16 and the accumulator is in registers, 128x128 fp32
# over 8 warps = 64 per thread beside the upcast operands: 182-244 registers, no spill for every pair (4 warps, or
# BLOCK_K 256 for FP4, spilled: the audit). Emulation for numerics studies, not a fast path.
HOPPER_CONFIG = _config(128, 128, 128, 3, 8)
_INTERPRETER_CONFIG = _config(32, 32, 64, 1, 4, group=2)


def default_config(a: QuantizedTensor, b: QuantizedTensor, device: torch.device | None = None) -> triton.Config:
    """The launch config when the caller gives none: on a Blackwell datacenter GPU (sm_100) the first offered one
    (FP4 on both sides: BLOCK_K 256), elsewhere HOPPER_CONFIG."""
    if _interpreting():
        return _INTERPRETER_CONFIG
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 10:
        return HOPPER_CONFIG
    return FP4_CONFIGS[0] if a.format is E2M1 and b.format is E2M1 else MX8_CONFIGS[0]


def check_block_scaled_pair(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether the kernel takes this pair (raises on a pair no layout rule allows): both MX (E8M0, any of E4M3, E5M2,
    E2M1 each), or both NVFP4 (E4M3 scales, E2M1). Returns whether the pair is NVFP4."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"block_scaled_gemm wants A (M, K) and B (N, K) with the same K, got {a.shape} and {b.shape}")
    formats = {a.layout.scale_format, b.layout.scale_format}
    if formats == {ScaleFormat.E8M0}:
        return False
    if formats == {ScaleFormat.E4M3} and a.format is E2M1 and b.format is E2M1:
        return True
    raise ValueError(f"no block-scaled GEMM for {a.format.name}/{a.layout.name} x {b.format.name}/{b.layout.name}")


def block_scaled_gemm_triton(a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype = torch.float32,
                             config: triton.Config | None = None):
    """C (M, N) = A @ B.T from the row-major copies of A (M, K) and B (N, K) (use `b.t()` for a transposed copy).
    `config` forces one launch config and then returns (C, Triton's compiled kernel) so tools can read its
    resources; default: default_config's."""
    nvfp4 = check_block_scaled_pair(a, b)
    (data_a, scale_a), (data_b, scale_b) = a.row_major(), b.row_major()
    (M, K), N = a.shape, b.shape[0]
    dev = data_a.device
    out = torch.empty((M, N), device=dev, dtype=out_dtype)
    chosen = config or default_config(a, b, dev)
    bm, bn, bk = (chosen.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    group_k = a.layout.block[1]
    if bk % group_k or bk % 64:
        raise ValueError(f"BLOCK_K {bk} must be a multiple of 64 and of the scale group {group_k}")
    # TMA: 16-byte aligned rows (K padded with zero bytes: +0 in FP8 and E2M1; padded groups read scale 1).
    data_a, data_b = _tma_ready(data_a), _tma_ready(data_b)
    pack_a, pack_b = (2 if q.format is E2M1 else 1 for q in (a, b))
    a_desc = TensorDescriptor.from_tensor(data_a, [bm, bk // pack_a])
    b_desc = TensorDescriptor.from_tensor(data_b, [bn, bk // pack_b])
    scale_a, scale_b = (s.contiguous().view(torch.uint8) for s in (scale_a, scale_b))  # E4M3 bytes read as uint8
    ga = a.global_scale_inv.float().reshape(()) if nvfp4 else out
    gb = b.global_scale_inv.float().reshape(()) if nvfp4 else out
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    kernel = _block_scaled_gemm_kernel[grid](
        a_desc, b_desc, out, scale_a, scale_b, ga, gb, M, N, K, out.stride(0), scale_a.stride(0), scale_b.stride(0),
        scale_a.shape[1], scale_b.shape[1], A_FORMAT=_DOT_FORMAT[a.format.name], B_FORMAT=_DOT_FORMAT[b.format.name],
        GROUP_K=group_k, SA_ROWS=a.layout.block[0], SB_ROWS=b.layout.block[0], SCALE_E4M3=nvfp4, HAS_ALPHA=nvfp4,
        SOFTWARE_BF16=_interpreting() and out_dtype == torch.bfloat16,
        **chosen.kwargs, num_warps=chosen.num_warps, num_stages=chosen.num_stages)
    return (out, kernel) if config is not None else out


__all__ = ["BLOCK_SCALED_GEMM_KERNEL_NAME", "FP4_CONFIGS", "HOPPER_CONFIG", "MX8_CONFIGS", "block_scaled_gemm_triton",
           "check_block_scaled_pair", "default_config"]
