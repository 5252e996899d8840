"""quantize_microscaled: a tensor to an MXFP8, MXFP4 or NVFP4 QuantizedTensor (the row-major copy and, with
`transpose`, the transposed copy quantized separately from high precision, optionally Hadamard-transformed and
stochastically rounded). Triton on CUDA tensors (microscaling_triton.py), the torch twin elsewhere
(microscaling_reference.py), bit for bit the same; `backend=` or MEGAFP8_KERNEL_BACKEND overrides, as for FP8."""
from __future__ import annotations

import torch

from .dispatch import resolve_backend
from .formats import E2M1, ElementFormat, ScaleFormat, ScaleLayout
from .microscaling_reference import (
    mx_quantize_copy,
    nvfp4_encode_scale,
    nvfp4_quantize_copy,
    pack_e2m1,
    random_hadamard_transform,
    transposed_key,
    unpack_e2m1,
)
from .quantized_tensor import QuantizedTensor


def quantize_microscaled(x: torch.Tensor, fmt: ElementFormat, layout: ScaleLayout, *, transpose: bool = False,
                         hadamard_transposed: bool = False, key: int | None = None, scale_rounding: str = "ceil",
                         encode_scale: torch.Tensor | None = None, stats: bool = False, backend: str | None = None,
                         ) -> tuple[QuantizedTensor, torch.Tensor, torch.Tensor | None]:
    """x (rows, K) -> (QuantizedTensor, the row-major copy's block amaxes, its [saturated, flushed] counts or None).

    layout               MX_1X32 (E8M0 scales; `fmt` E4M3, E5M2 or E2M1) or NVFP4_1X16 / NVFP4_16X16 (E2M1)
    transpose            also the copy of x.T, quantized from x (a 16x16 layout: the same bytes, moved)
    hadamard_transposed  the transposed copy's rows go through the random Hadamard transform first (wgrad operands)
    key                  stochastic rounding with uniforms hash(key, index) (the transposed copy: its own key);
                         None rounds to nearest even
    scale_rounding       MX: "ceil" (RCEIL, the default) or "floor" (OCP)
    encode_scale         NVFP4: the per-tensor S_enc agreed over ranks (else this tensor's own)
    """
    if resolve_backend(x.device, backend) == "triton":
        from .microscaling_triton import quantize_microscaled_triton  # Triton is imported only where it is used

        return quantize_microscaled_triton(x, fmt, layout, transpose=transpose, hadamard_transposed=hadamard_transposed,
                                           key=key, scale_rounding=scale_rounding, encode_scale=encode_scale,
                                           stats=stats)
    if x.dim() != 2:
        raise ValueError(f"quantize_microscaled takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    x32 = x.float()
    if layout.scale_format == ScaleFormat.E8M0:
        data, scale, amax, counts = mx_quantize_copy(x32, fmt, scale_rounding=scale_rounding, key=key, stats=stats)
        result = QuantizedTensor((rows, cols), fmt, layout, data, scale)
        if transpose:
            xt = _transposed_input(x32, hadamard_transposed)
            data_t, scale_t, _, _ = mx_quantize_copy(xt, fmt, scale_rounding=scale_rounding, key=transposed_key(key))
            result.data_t, result.scale_inv_t = data_t, scale_t
        return result, amax, counts
    if layout.scale_format != ScaleFormat.E4M3 or fmt is not E2M1:
        raise ValueError(f"no microscaled quantizer for {fmt.name} elements in layout {layout.name}")
    data, scale, global_inv, amax, counts = nvfp4_quantize_copy(x32, layout, encode_scale=encode_scale, key=key,
                                                                stats=stats)
    result = QuantizedTensor((rows, cols), fmt, layout, data, scale, global_scale_inv=global_inv)
    if transpose:
        if layout.transpose_is_relayout and not hadamard_transposed and key is None:
            # 16x16 tiles and one S_enc: the transposed copy's every value and scale is this copy's, moved.
            result.data_t = pack_e2m1(unpack_e2m1(data).t().contiguous())
            result.scale_inv_t, result.global_scale_inv_t = scale.t().contiguous(), global_inv.clone()
        else:
            xt = _transposed_input(x32, hadamard_transposed)
            # The amax of the transformed copy, not x's: the transform moves mass between elements (TE).
            s_enc_t = encode_scale if encode_scale is not None and not hadamard_transposed else None
            data_t, scale_t, global_t, _, _ = nvfp4_quantize_copy(xt, layout, encode_scale=s_enc_t,
                                                                   key=transposed_key(key))
            result.data_t, result.scale_inv_t, result.global_scale_inv_t = data_t, scale_t, global_t
    return result, amax, counts


def _transposed_input(x32: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """What the transposed copy quantizes: x.T, through the Hadamard transform for the wgrad operands."""
    xt = x32.t().contiguous()
    return random_hadamard_transform(xt) if hadamard else xt


__all__ = ["quantize_microscaled", "nvfp4_encode_scale"]
