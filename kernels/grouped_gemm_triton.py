"""Triton grouped FP8 GEMMs: every local expert of an MoE layer in one launch (twin: grouped_gemm_reference.py).

fprop and dgrad (``_grouped_fp8_gemm_kernel``): C[rows of group g] = A[rows of g] @ B[g].T.

A (M, K) holds the groups' rows one after another (group g: rows ``[ends[g-1], ends[g])``, ends on the device, never
read on the host); B (G, N, K) is every group's K-major operand, read as one (G N, K) tensor by TMA. Each program owns
one (BLOCK_M, BLOCK_N) tile of one group: the grid is the upper bound ``(cdiv(M, BLOCK_M) + G) x cdiv(N, BLOCK_N)`` of
the groups' tiles (a group of r rows has cdiv(r, BLOCK_M)); a program finds its group by walking the G ends (G is the
local experts, tens), and the programs past the last tile return. A tile's TMA loads may reach into the next group's
rows of A or B (a group's rows start anywhere, N need not be a multiple of BLOCK_N): those rows and columns are masked
out of the store, never summed into another group's output.

Scale modes, as gemm.py's (scaling.GemmScaleMode):
  rowwise    sa (M, 1), sb (G, N, 1), applied in the epilogue (a tensorwise recipe's per-group scalars arrive
             expanded to rows); `fast_accum` lets the tensor core accumulate over all of K (fprop);
  blockwise  sa (M, K/128) 1x128, sb (G, N/128, K/128) 128x128, each 128-wide K step's partial product scaled
             before it joins the fp32 accumulator (DeepSeek-V3's promotion).
wgrad (``_grouped_fp8_wgrad_kernel``) groups along K instead: C[g] (M, N) = A[:, g's columns] @ B[:, g's columns].T
for the experts' transposed copies dY^T (M = out features, K = tokens) and x^T laid side by side, each expert's tokens
padded with zero columns to a multiple of 128 (so a K step, and a 1x128 scale group, never mixes two experts); modes
rowwise (each group's own (M, 1) / (N, 1) scales, tensorwise expanded) and blockwise 1x128 x 1x128 (the scales of the
padded columns' token groups), into a (G, M, N) fp32 result.

Not persistent and without gemm.py's grouped tile order: the expert GEMMs are small and many; a GPU has not timed it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import _tma_ready
from .quantize_triton import _interpreting
from .scaling import BLOCK, GemmScaleMode

GROUPED_GEMM_KERNEL_NAME = "_grouped_fp8_gemm_kernel"
GROUPED_WGRAD_KERNEL_NAME = "_grouped_fp8_wgrad_kernel"


@triton.jit
def _grouped_fp8_gemm_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, ends_ptr, N, K, G, stride_cm,
                             stride_sa_m, stride_sa_k, stride_sb_g, stride_sb_n, stride_sb_k,
                             BLOCKWISE: tl.constexpr, FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    grid_n = tl.cdiv(N, BLOCK_N)
    tile_m, pid_n = tl.program_id(0) // grid_n, tl.program_id(0) % grid_n
    # This program's group: the one whose tiles (counted over the groups before it) include tile_m.
    group = tl.full([], -1, tl.int32)
    row_start = tl.full([], 0, tl.int32)
    row_end = tl.full([], 0, tl.int32)
    start = tl.full([], 0, tl.int32)
    tiles_before = tl.full([], 0, tl.int32)
    for g in tl.range(0, G):
        end = tl.load(ends_ptr + g).to(tl.int32)
        tiles = tl.cdiv(end - start, BLOCK_M)
        hit = (tile_m >= tiles_before) & (tile_m < tiles_before + tiles)
        group = tl.where(hit, g, group)
        row_start = tl.where(hit, start + (tile_m - tiles_before) * BLOCK_M, row_start)
        row_end = tl.where(hit, end, row_end)
        tiles_before += tiles
        start = end
    if group >= 0:
        offs_m = row_start + tl.arange(0, BLOCK_M).to(tl.int64)  # int64: offsets may exceed 2**31
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        m_ok, n_ok = offs_m < row_end, offs_n < N
        b_row = group * N + pid_n * BLOCK_N
        sb_group = sb_ptr + group.to(tl.int64) * stride_sb_g
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FAST_ACCUM:
            for k_step in tl.range(0, tl.cdiv(K, BLOCK_K)):
                a = a_desc.load([row_start, k_step * BLOCK_K])
                b = b_desc.load([b_row, k_step * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
        else:
            for k_step in tl.range(0, tl.cdiv(K, BLOCK_K)):
                a = a_desc.load([row_start, k_step * BLOCK_K])
                b = b_desc.load([b_row, k_step * BLOCK_K])
                partial = tl.dot(a, b.T)
                if BLOCKWISE:  # BLOCK_K == 128: one scale group per K step
                    sa = tl.load(sa_ptr + offs_m * stride_sa_m + k_step * stride_sa_k, mask=m_ok, other=0.0)
                    sb = tl.load(sb_group + (offs_n // 128) * stride_sb_n + k_step * stride_sb_k, mask=n_ok,
                                 other=0.0)
                    acc += partial * sa[:, None] * sb[None, :]
                else:
                    acc += partial
        if not BLOCKWISE:
            sa = tl.load(sa_ptr + offs_m * stride_sa_m, mask=m_ok, other=0.0)
            sb = tl.load(sb_group + offs_n * stride_sb_n, mask=n_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        c_mask = m_ok[:, None] & n_ok[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_fp8_wgrad_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, sizes_ptr, M, N, stride_cg, stride_cm,
                              stride_sa_g, stride_sa_m, stride_sa_k, stride_sb_g, stride_sb_n, stride_sb_k,
                              BLOCKWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """C[g] (M, N) = A[:, columns of g] @ B[:, columns of g].T: the groups run along K (wgrad's tokens). Group g's
    columns start where the groups before it end, each padded with zero columns to a multiple of BLOCK_K (= 128, the
    1x128 token groups), so no K step mixes two groups."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group, tile = pid // (tiles_m * tiles_n), pid % (tiles_m * tiles_n)
    pid_m, pid_n = tile // tiles_n, tile % tiles_n
    first_step = tl.full([], 0, tl.int32)
    for g in tl.range(0, group):
        first_step += tl.cdiv(tl.load(sizes_ptr + g).to(tl.int32), BLOCK_K)
    steps = tl.cdiv(tl.load(sizes_ptr + group).to(tl.int32), BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.range(first_step, first_step + steps):
        a = a_desc.load([pid_m * BLOCK_M, step * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, step * BLOCK_K])
        partial = tl.dot(a, b.T)
        if BLOCKWISE:  # 1x128 x 1x128: each K step's token group scales its partial product
            sa = tl.load(sa_ptr + offs_m * stride_sa_m + step * stride_sa_k, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + offs_n * stride_sb_n + step * stride_sb_k, mask=n_ok, other=0.0)
            acc += partial * sa[:, None] * sb[None, :]
        else:
            acc += partial
    if not BLOCKWISE:  # each group's own per-row scales
        sa = tl.load(sa_ptr + group * stride_sa_g + offs_m * stride_sa_m, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + group * stride_sb_g + offs_n * stride_sb_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


# The audited non-spilling shape of gemm.py's precise kernel (128x128x128, 8 warps, 3 stages); small tiles in the
# interpreter, so a test's few rows span several tiles and groups.
SM90_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=BLOCK, num_warps=8, num_stages=3)
FALLBACK_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=BLOCK, num_warps=4, num_stages=3)
_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=BLOCK, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> dict:
    if _interpreting():
        return _INTERPRETER_CONFIG
    return SM90_CONFIG if torch.cuda.get_device_capability(device)[0] == 9 else FALLBACK_CONFIG


def _launch_setup(a: torch.Tensor, b: torch.Tensor, config: dict | None):
    """(tile sizes, the rest of the launch config, A's and B's TMA descriptors) of one launch; BLOCK_K is 128 always:
    one 1x128 scale group per K step, and the wgrad's groups are padded to 128 columns."""
    config = dict(config or default_config(a.device))
    blocks = {name: config.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    if blocks["BLOCK_K"] != BLOCK:
        raise ValueError(f"the grouped FP8 GEMMs run BLOCK_K = {BLOCK}, got {blocks['BLOCK_K']}")
    a_desc = TensorDescriptor.from_tensor(_tma_ready(a), [blocks["BLOCK_M"], blocks["BLOCK_K"]])
    b_desc = TensorDescriptor.from_tensor(_tma_ready(b), [blocks["BLOCK_N"], blocks["BLOCK_K"]])
    return blocks, config, a_desc, b_desc


def grouped_fp8_gemm_triton(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                            group_ends: torch.Tensor, mode: GemmScaleMode, out_dtype: torch.dtype = torch.float32,
                            fast_accum: bool = False, config: dict | None = None):
    """The twin's arguments (grouped_gemm.grouped_fp8_gemm checked them). `config` forces one launch config and then
    returns (out, Triton's compiled kernel), for tools that read its resources. Rows after the last group's end are
    left unwritten."""
    (M, K), (G, N, _) = a.shape, b.shape
    forced = config is not None
    blocks, config, a_desc, b_desc = _launch_setup(a, b.reshape(G * N, K), config)
    out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    blockwise = mode == GemmScaleMode.BLOCKWISE
    grid = ((triton.cdiv(M, blocks["BLOCK_M"]) + G) * triton.cdiv(N, blocks["BLOCK_N"]),)
    kernel = _grouped_fp8_gemm_kernel[grid](
        a_desc, b_desc, out, scale_a, scale_b, group_ends, N, K, G, out.stride(0),
        scale_a.stride(0), scale_a.stride(1), *scale_b.stride(), BLOCKWISE=blockwise, FAST_ACCUM=fast_accum,
        **blocks, **config)
    return (out, kernel) if forced else out


def grouped_fp8_wgrad_triton(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                             group_sizes: torch.Tensor, mode: GemmScaleMode, config: dict | None = None):
    """The twin's arguments (grouped_gemm.grouped_fp8_wgrad checked them); fp32 (G, M, N). `config` as for
    grouped_fp8_gemm_triton."""
    (M, _), N, G = a.shape, b.shape[0], group_sizes.numel()
    forced = config is not None
    blocks, config, a_desc, b_desc = _launch_setup(a, b, config)
    out = torch.empty((G, M, N), device=a.device, dtype=torch.float32)
    blockwise = mode == GemmScaleMode.BLOCKWISE_1X128
    # Blockwise scales are (rows, K / 128) along the padded columns; rowwise ones (G, rows, 1), one set per group.
    sa_strides = (0, *scale_a.stride()) if blockwise else scale_a.stride()
    sb_strides = (0, *scale_b.stride()) if blockwise else scale_b.stride()
    grid = (G * triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(N, blocks["BLOCK_N"]),)
    kernel = _grouped_fp8_wgrad_kernel[grid](
        a_desc, b_desc, out, scale_a, scale_b, group_sizes, M, N, out.stride(0), out.stride(1), *sa_strides,
        *sb_strides, BLOCKWISE=blockwise, **blocks, **config)
    return (out, kernel) if forced else out
