"""NVFP4 weights in the compressed-tensors layout (format ``nvfp4-pack-quantized``, scheme NVFP4A16: FP4 weights, the
activations left to the serving stack), what vLLM and transformers read from a ``quantization_config`` with
``quant_method: compressed-tensors``: per linear ``weight_packed`` (uint8 [out, in/2], two E2M1 codes per byte, the
even element in the low nibble), ``weight_scale`` (float8_e4m3fn [out, in/16]) and ``weight_global_scale`` (float32
[1], S_enc = 448 * 6 / amax), so ``weight = e2m1 * weight_scale / weight_global_scale``.

The values are the ones megafp8's NVFP4 recipe trains with: TransformerEngine's scale chain over 16x16 weight tiles,
each tile's scale written once per row of the tile (a 1x16 group of the layout)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megafp8.checkpoint.fp8_export import HF_LAYER_LINEARS, bf16_layers, guard_switched_hf_linears
from megafp8_kernels.formats import E2M1, NVFP4_16X16
from megafp8_kernels.microscaling import quantize_microscaled

GROUP = 16
SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


def quantization_config(num_layers: int, saved_args: Mapping[str, Any], switched: Iterable[str] = ()) -> dict[str, Any]:
    """config.json's ``quantization_config``: compressed-tensors' NVFP4A16 scheme on every Linear, ``ignore`` naming
    the linears kept in bf16 (``lm_head``, the layers trained in BF16, those the saturation guard switched)."""
    ignore = ["lm_head"] + [f"model.layers.{i}.{linear}" for i in bf16_layers(num_layers, saved_args)
                            for linear in HF_LAYER_LINEARS]
    ignore += [name for name in guard_switched_hf_linears(switched) if name not in ignore]
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "nvfp4-pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None}


def planned_tensors(name: str, shape: tuple[int, int]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The three tensors that replace HF weight ``name`` (``...q_proj.weight``) of ``shape`` [out, in]."""
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"{name}: NVFP4 groups of {GROUP} need the input dimension ({cols}) to be a multiple")
    base = name.removesuffix("weight")
    return [(base + "weight_packed", (rows, cols // 2), torch.uint8),
            (base + "weight_scale", (rows, cols // GROUP), torch.float8_e4m3fn),
            (base + "weight_global_scale", (1,), torch.float32)]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (weight_packed, weight_scale, weight_global_scale), quantized as the NVFP4 recipe's weights."""
    q = quantize_microscaled(weight.float(), E2M1, NVFP4_16X16, backend="reference")[0]
    per_row = q.scale_inv.repeat_interleave(GROUP, dim=0)[:weight.shape[0]].contiguous()
    return q.data.contiguous(), per_row, (1.0 / q.global_scale_inv.float()).reshape(1)


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """What a compressed-tensors loader reconstructs (float32): e2m1 * weight_scale / weight_global_scale."""
    from megafp8_kernels.microscaling_reference import e2m1_values, unpack_e2m1

    values = e2m1_values(unpack_e2m1(packed))
    return values * (scale.float() / global_scale.float()).repeat_interleave(GROUP, dim=1)
