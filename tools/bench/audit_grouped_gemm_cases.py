"""The grouped FP8 GEMMs' cases for the offline sm_90a audit (kernel_audit.py's family "grouped gemm"): an MoE layer's
fprop and dgrad grouped by rows and its wgrad grouped along the tokens, at the kernels' Hopper config."""
from __future__ import annotations

GROUPED_GEMM_CASES = (("rowwise fast-accum fprop e4m3xe4m3 bf16", "rowwise", "e4m3", True),
                      ("rowwise dgrad e5m2xe4m3 bf16", "rowwise", "e5m2", False),
                      ("blockwise fprop e4m3xe4m3 bf16", "blockwise", "e4m3", False),
                      ("blockwise dgrad e5m2xe4m3 bf16", "blockwise", "e5m2", False))


def grouped_gemm_cases():
    """(case label, kernel name, call) of the grouped FP8 GEMM (grouped_gemm_triton.py: an MoE layer's fprop and dgrad
    over its local experts) at its Hopper config: 8 experts of 512 x 1024 weights, 1000 rows split unevenly, in each
    mode it runs (tensorwise recipes arrive as rowwise), fprop E4M3 and dgrad with E5M2 gradients, to bf16."""
    import torch

    from megafp8_kernels import GemmScaleMode
    from megafp8_kernels.grouped_gemm_triton import GROUPED_GEMM_KERNEL_NAME, SM90_CONFIG, grouped_fp8_gemm_triton

    groups, M, N, K = 8, 1000, 512, 1024
    ends = torch.tensor([90, 250, 250, 400, 610, 700, 880, 1000], dtype=torch.int32)
    b = torch.zeros(groups, N, K, dtype=torch.float8_e4m3fn)
    for label, mode_name, a_dtype, fast in GROUPED_GEMM_CASES:
        mode = GemmScaleMode(mode_name)
        a = torch.zeros(M, K, dtype={"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[a_dtype])
        if mode is GemmScaleMode.ROWWISE:
            sa, sb = torch.ones(M, 1), torch.ones(groups, N, 1)
        else:
            # Row-major 1x128 scales: the concatenation of the experts' scales the MoE path hands over
            sa, sb = torch.ones(M, K // 128), torch.ones(groups, N // 128, K // 128)
        yield label, GROUPED_GEMM_KERNEL_NAME, lambda a=a, sa=sa, sb=sb, mode=mode, fast=fast: \
            grouped_fp8_gemm_triton(a, b, sa, sb, ends, mode, torch.bfloat16, fast, config=SM90_CONFIG)


GROUPED_WGRAD_CASES = (("rowwise wgrad e5m2xe4m3 fp32", "rowwise"),
                       ("blockwise_1x128 wgrad e5m2xe4m3 fp32", "blockwise_1x128"))


def grouped_wgrad_cases():
    """(case label, kernel name, call) of the grouped wgrad (the same 8 experts' dW = dY^T X, grouped along their
    tokens, each padded to 128), E5M2 gradients times E4M3 inputs into fp32, rowwise and 1x128 x 1x128."""
    import torch

    from megafp8_kernels import GemmScaleMode
    from megafp8_kernels.grouped_gemm_triton import GROUPED_WGRAD_KERNEL_NAME, SM90_CONFIG, grouped_fp8_wgrad_triton

    sizes = torch.tensor([90, 160, 0, 150, 210, 90, 180, 120], dtype=torch.int32)
    M, N, K = 512, 1024, 128 * 11  # K: the tokens, each expert's padded to 128
    a, b = torch.zeros(M, K, dtype=torch.float8_e5m2), torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    for label, mode_name in GROUPED_WGRAD_CASES:
        mode = GemmScaleMode(mode_name)
        if mode is GemmScaleMode.ROWWISE:
            sa, sb = torch.ones(8, M, 1), torch.ones(8, N, 1)
        else:
            sa, sb = torch.ones(M, K // 128), torch.ones(N, K // 128)
        yield label, GROUPED_WGRAD_KERNEL_NAME, lambda sa=sa, sb=sb, mode=mode: \
            grouped_fp8_wgrad_triton(a, b, sa, sb, sizes, mode, config=SM90_CONFIG)
