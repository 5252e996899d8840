"""The cuBLAS/CUTLASS path for tensorwise and rowwise FP8 GEMMs: torch._scaled_mm, and when dispatch may use it.

On CUDA, `fp8_gemm` with the auto backend sends the scale modes named in MEGAFP8_SCALED_MM_MODES to
torch._scaled_mm instead of the Triton kernel, when the call is one _scaled_mm computes the same way:
  - tensorwise: any supported dtype pair and output dtype;
  - rowwise: E4M3 x E4M3 with a bf16 output (the only rowwise combination torch's kernel takes);
  - no bias and no accumulate (those stay fused in the Triton epilogue: _scaled_mm would need an
    extra pass over C), and M, N, K multiples of 16 (cuBLASLt's FP8 alignment).
use_fast_accum=False: cuBLAS then promotes partial sums to fp32 as the Triton kernel does every K step.
Blockwise modes always run the Triton kernel. The default set is reasoned, not measured (no GPU was
available when it was chosen): cuBLASLt's tensorwise FP8 GEMM is the vendor's tuned path. Run
tools/bench/bench_gemm.py on the GPU and set the variable from its "faster" column.
"""
from __future__ import annotations

import os

import torch

from .scaling import GemmScaleMode

SCALED_MM_ENV_VAR = "MEGAFP8_SCALED_MM_MODES"
DEFAULT_SCALED_MM_MODES = (GemmScaleMode.TENSORWISE, GemmScaleMode.ROWWISE)
_ELIGIBLE_MODES = DEFAULT_SCALED_MM_MODES


def scaled_mm_modes() -> tuple[GemmScaleMode, ...]:
    """The scale modes the auto backend routes to torch._scaled_mm on CUDA (from MEGAFP8_SCALED_MM_MODES)."""
    value = os.environ.get(SCALED_MM_ENV_VAR)
    if value is None:
        return DEFAULT_SCALED_MM_MODES
    names = [name.strip() for name in value.split(",") if name.strip() and name.strip() != "none"]
    allowed = {mode.value: mode for mode in _ELIGIBLE_MODES}
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{SCALED_MM_ENV_VAR}={value!r}: {', '.join(unknown)} cannot run on torch._scaled_mm; "
                         f"give a comma-separated subset of {', '.join(allowed)}, or 'none'")
    return tuple(allowed[name] for name in names)


def scaled_mm_supports(mode: GemmScaleMode, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                       bias: torch.Tensor | None, accumulate: bool) -> str | None:
    """None if torch._scaled_mm computes this call like the Triton kernel, else the reason it cannot."""
    if mode not in _ELIGIBLE_MODES:
        return f"{mode.value} scales"
    if bias is not None or accumulate:
        return "a bias or accumulate (fused only in the Triton epilogue)"
    (M, K), N = a.shape, b.shape[0]
    if M % 16 or N % 16 or K % 16:
        return f"M, N, K = {M}, {N}, {K} not all multiples of 16"
    if mode is GemmScaleMode.ROWWISE and (
            out_dtype != torch.bfloat16 or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn):
        return "rowwise needs E4M3 x E4M3 with a bf16 output"
    return None


def fp8_gemm_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       mode: GemmScaleMode, out_dtype: torch.dtype, out: torch.Tensor | None = None,
                       fast_accum: bool = False) -> torch.Tensor:
    """C = (A * scale_a) @ (B * scale_b).T through torch._scaled_mm (call scaled_mm_supports first).
    `fast_accum` (fprop only) lets cuBLAS skip the fp32 promotion of partial sums."""
    if mode is GemmScaleMode.TENSORWISE:
        sa, sb = scale_a.reshape(()), scale_b.reshape(())
    else:
        sa, sb = scale_a.reshape(-1, 1).contiguous(), scale_b.reshape(1, -1).contiguous()
    # b is (N, K) row-major, so b.t() is the column-major (K, N) operand _scaled_mm wants: no copy.
    kwargs = dict(out_dtype=out_dtype, use_fast_accum=fast_accum)
    if out is not None:
        return torch._scaled_mm(a.contiguous(), b.contiguous().t(), sa, sb, out=out, **kwargs)
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), sa, sb, **kwargs)
