"""128x128 block-scaled E4M3 weights, the layout of DeepSeek-V3-style FP8 checkpoints (``weight`` in
float8_e4m3fn plus a float32 ``weight_scale_inv`` of shape [ceil(out/128), ceil(in/128)], where
``weight ≈ fp8.float() * weight_scale_inv`` expanded block-wise)."""
from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def _blocked(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``weight`` zero-padded to whole blocks, viewed as [rows/128, 128, cols/128, 128]."""
    rows, cols = weight.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight
    return padded.view(br, BLOCK, bc, BLOCK), br, bc


def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (float8_e4m3fn weight, float32 weight_scale_inv [ceil(out/128), ceil(in/128)])."""
    blocks, br, bc = _blocked(weight.float())
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # an all-zero block: any scale
    quantized = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    rows, cols = weight.shape
    return quantized.reshape(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous(), scale_inv


def dequantize_blockwise(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight a block-FP8 loader reconstructs."""
    blocks, br, bc = _blocked(quantized.float())
    rows, cols = quantized.shape
    return (blocks * scale_inv[:, None, :, None]).reshape(br * BLOCK, bc * BLOCK)[:rows, :cols]
