"""Hopper (sm_90a) FP8 GEMM for the precise path, in Gluon: DeepGEMM's fp32 promotion every 128 of K, one wgmma in flight.

Why Gluon: Triton's loop pipeliner makes a `tl.dot` "properly async" only when its result feeds the next
dot's accumulator; a result that fp32 code reads (the promotion `acc += partial * sa * sb`) gets a
`wgmma.wait_group 0` right after the dot, and ptxas serializes any register read of an in-flight wgmma
anyway (WARPGROUP.DEPBAR 0 before it, even under a PTX `wait_group 1`). Gluon states the schedule, per
pair of K steps (an odd last step alone):

    issue wgmma(k) into register set A, wgmma(k+1) into set B
    warpgroup_mma_wait(1): step k is done, step k+1 stays in flight
    refill step k's ring slot by TMA; acc += A * sa[:, k] * sb[k]     (CUDA cores, under step k+1)
    warpgroup_mma_wait(0); refill step k+1's slot; acc += B * sa[:, k+1] * sb[k+1]

Nothing stays in flight across the loop's back edge (a loop-carried in-flight accumulator gets copied
there, and ptxas then serializes every wgmma). The promotion is the Triton kernel's expression in the
same order (`acc += partial * sa[:, None] * sb[None, :]`, K steps ascending), so both round alike;
tests/test_gemm_promotion.py checks the order bit-exactly for gemm.py's kernel in the interpreter (which
cannot run Gluon) and, within the GPU's FMA contraction, for this one on a Hopper GPU (gpu-marked). Same arguments, persistent grouped grid
and epilogue as gemm.py's kernel; tools/bench/kernel_audit.py checks this one's sm_90a SASS offline.
"""
from __future__ import annotations

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gemm import _epilogue

# Gluon's API moves between Triton releases; the GPU image's torch 2.11 + CUDA 13 pins Triton 3.6, which names TMA's
# global->shared copy `tma.async_copy_global_to_shared` and the CTA barrier `gl.thread_barrier` (3.9 renamed them
# `tma.async_load` / `gl.barrier`, and its old TMA name only raises). Resolved once here so the kernel compiles
# under both (kernel_audit.py compiles it for sm_90a under each: docs/kernels.md).
_tma_async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

HOPPER_GEMM_KERNEL_NAME = "_fp8_gemm_promoted_kernel"

_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


@gluon.jit
def _step_scales(sa_ptr, sb_ptr, k_step, offs_m, offs_n, m_ok, n_ok, off_n,
                 stride_sa_m, stride_sa_k, stride_sb_n, stride_sb_k, SCALE_MODE: gl.constexpr, BLOCK_N: gl.constexpr):
    """K step `k_step`'s scales (blockwise modes; 1.0 placeholders otherwise): sa (BLOCK_M,), sb (BLOCK_N,) or scalar."""
    if SCALE_MODE >= 2:
        sa = gl.load(sa_ptr + offs_m * stride_sa_m + k_step * stride_sa_k, mask=m_ok, other=0.0)
        if SCALE_MODE == 2 and 128 % BLOCK_N == 0:
            # A tile of BLOCK_N <= 128 columns lies in one 128-row block of B: one scalar, no vector registers.
            sb = gl.load(sb_ptr + (off_n // 128) * stride_sb_n + k_step * stride_sb_k)
        elif SCALE_MODE == 2:
            sb = gl.load(sb_ptr + (offs_n // 128) * stride_sb_n + k_step * stride_sb_k, mask=n_ok, other=0.0)
        else:
            sb = gl.load(sb_ptr + offs_n * stride_sb_n + k_step * stride_sb_k, mask=n_ok, other=0.0)
    else:
        sa, sb = 1.0, 1.0
    return sa, sb


@gluon.jit
def _promote(acc, partial, sa, sb, SCALE_MODE: gl.constexpr, BLOCK_N: gl.constexpr):
    """acc + partial (tensorwise/rowwise: scales in the epilogue) or acc + partial * sa * sb (blockwise),
    the same expression as gemm.py's kernel."""
    if SCALE_MODE >= 2:
        if SCALE_MODE == 2 and 128 % BLOCK_N == 0:
            acc += partial * sa[:, None] * sb
        else:
            acc += partial * sa[:, None] * sb[None, :]
    else:
        acc += partial
    return acc


@gluon.jit
def _load_step(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, k_step, ring_index, pred,
               STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
    """TMA loads of K step `k_step` into ring slot `ring_index % STAGES` (when `pred`)."""
    slot = ring_index % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    _tma_async_load(a_desc, [off_m, k_step * BLOCK_K], bar, a_smem.index(slot), pred=pred)
    _tma_async_load(b_desc, [off_n, k_step * BLOCK_K], bar, b_smem.index(slot), pred=pred)


@gluon.jit
def _mma_step(a_smem, b_smem, ready, ring_index, zero, STAGES: gl.constexpr):
    """Waits for ring slot `ring_index`'s data, then issues its wgmma into a fresh accumulator (not waited)."""
    slot = ring_index % STAGES
    mbarrier.wait(ready.index(slot), (ring_index // STAGES) & 1)
    return warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _fp8_gemm_promoted_kernel(a_desc, b_desc, c_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, K,
                              stride_cm, stride_sa_m, stride_sa_k, stride_sb_n, stride_sb_k,
                              SCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # wgmma m64 per warpgroup: warps stacked along M (8 warps = 2 warpgroups of 64 rows each).
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    PRELOAD_NEXT_SCALES: gl.constexpr = SCALE_MODE != 3 or BLOCK_N <= 64

    grid_m, grid_n = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    num_tiles = grid_m * grid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    group_size = GROUP_M * grid_n
    ring = 0  # K steps loaded so far by this program, over all its tiles: ring slot and barrier phase
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        first_m = (tile // group_size) * GROUP_M
        rows_in_group = gl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group_size) % rows_in_group
        pid_n = (tile % group_size) // rows_in_group
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        # int32 in the K loop (scale offsets are small; fewer registers), int64 for C's offsets in the epilogue.
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        m_ok, n_ok = offs_m < M, offs_n < N

        for j in gl.static_range(STAGES):  # the previous tile left every slot free: fill the whole ring
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, j, ring + j, j < k_steps,
                       STAGES, BLOCK_K)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
        # Two K steps per iteration: step k+1's wgmma runs while step k is promoted. Nothing stays in flight
        # across the loop's back edge (a loop-carried in-flight accumulator is copied there, and ptxas then
        # serializes every wgmma).
        for k in range(0, k_steps - 1, 2):
            # Scales first: their loads' latency then hides under the wgmmas instead of delaying the promotion
            # (loaded after the wait, they let ptxas hoist the next wait above the promotion).
            sa_k, sb_k = _step_scales(sa_ptr, sb_ptr, k, offs_m, offs_n, m_ok, n_ok, off_n, stride_sa_m,
                                      stride_sa_k, stride_sb_n, stride_sb_k, SCALE_MODE, BLOCK_N)
            if PRELOAD_NEXT_SCALES:
                sa_next, sb_next = _step_scales(sa_ptr, sb_ptr, k + 1, offs_m, offs_n, m_ok, n_ok, off_n, stride_sa_m,
                                                stride_sa_k, stride_sb_n, stride_sb_k, SCALE_MODE, BLOCK_N)
            pending_k = _mma_step(a_smem, b_smem, ready, ring + k, zero, STAGES)
            pending_next = _mma_step(a_smem, b_smem, ready, ring + k + 1, zero, STAGES)
            partial = warpgroup_mma_wait(num_outstanding=1, deps=(pending_k,))
            _cta_barrier()  # every warpgroup is done with step k's slot before TMA refills it
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, k + STAGES, ring + k + STAGES,
                       k + STAGES < k_steps, STAGES, BLOCK_K)
            if not PRELOAD_NEXT_SCALES:
                # Step k+1's scales load here, during step k's promotion: two sets of 1x128 column scales
                # (32 registers each at BLOCK_N 128) do not fit next to three accumulators.
                sa_next, sb_next = _step_scales(sa_ptr, sb_ptr, k + 1, offs_m, offs_n, m_ok, n_ok, off_n, stride_sa_m,
                                                stride_sa_k, stride_sb_n, stride_sb_k, SCALE_MODE, BLOCK_N)
            acc = _promote(acc, partial, sa_k, sb_k, SCALE_MODE, BLOCK_N)
            # `acc` goes through the wait so that the compiler cannot sink step k's promotion below it.
            partial, acc = warpgroup_mma_wait(num_outstanding=0, deps=(pending_next, acc))
            _cta_barrier()
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, k + 1 + STAGES, ring + k + 1 + STAGES,
                       k + 1 + STAGES < k_steps, STAGES, BLOCK_K)
            acc = _promote(acc, partial, sa_next, sb_next, SCALE_MODE, BLOCK_N)
        if k_steps % 2 == 1:  # the last, unpaired K step
            sa_k, sb_k = _step_scales(sa_ptr, sb_ptr, k_steps - 1, offs_m, offs_n, m_ok, n_ok, off_n, stride_sa_m,
                                      stride_sa_k, stride_sb_n, stride_sb_k, SCALE_MODE, BLOCK_N)
            pending_k = _mma_step(a_smem, b_smem, ready, ring + k_steps - 1, zero, STAGES)
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(pending_k,))
            acc = _promote(acc, partial, sa_k, sb_k, SCALE_MODE, BLOCK_N)
        _cta_barrier()  # the next tile's prologue refills slots this tile's last steps read
        ring += k_steps

        _epilogue(acc, c_ptr, bias_ptr, sa_ptr, sb_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, stride_sa_m,
                  stride_sb_n, SCALE_MODE, HAS_BIAS, ACCUMULATE)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def descriptor(x: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """Gluon TMA descriptor of a K-major FP8 operand (call gemm._tma_ready first)."""
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block_shape, layout)


def launch(a: torch.Tensor, b: torch.Tensor, operands: tuple, meta: dict, config: triton.Config, programs: int):
    """Runs the kernel on gemm.py's arguments after the descriptors (`operands`: C, bias, scales, M, N, K,
    strides) and its meta-parameters; returns Triton's compiled kernel."""
    c = config.kwargs
    M, N = operands[4], operands[5]
    tiles = triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"])
    a_desc = descriptor(a, [c["BLOCK_M"], c["BLOCK_K"]])
    b_desc = descriptor(b, [c["BLOCK_N"], c["BLOCK_K"]])
    return _fp8_gemm_promoted_kernel[(min(programs, tiles),)](
        a_desc, b_desc, *operands, **meta, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        GROUP_M=c["GROUP_M"], STAGES=config.num_stages, num_warps=config.num_warps)
