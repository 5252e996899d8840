"""Microscaled HF exports in the compressed-tensors layouts that vLLM and transformers read (``quant_method:
compressed-tensors``; weights only, the activations left to the serving stack):

  hf-nvfp4  format ``nvfp4-pack-quantized`` (scheme NVFP4A16): ``weight_packed`` (uint8 [out, in/2], two E2M1 codes
            per byte, the even element in the low nibble), ``weight_scale`` (float8_e4m3fn [out, in/16]) and
            ``weight_global_scale`` (float32 [1], S_enc = 448 * 6 / amax): weight = e2m1 * weight_scale / global.
            The values are the NVFP4 recipe's: TransformerEngine's scale chain over 16x16 weight tiles, each tile's
            scale written once per row of the tile (a 1x16 group of the layout).
  hf-mxfp8  format ``mxfp8-quantized`` (scheme MXFP8A16): ``weight`` (float8_e4m3fn [out, in]) and ``weight_scale``
            (uint8 E8M0 exponents [out, in/32]): weight = e4m3 * 2^(scale - 127), the MXFP8 recipe's fprop copy
            (RCEIL scales along the input dimension)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megafp8.checkpoint.fp8_export import HF_LAYER_LINEARS, bf16_layers, guard_switched_hf_linears
from megafp8_kernels.formats import E2M1, E4M3, MX_1X32, NVFP4_16X16
from megafp8_kernels.microscaling import quantize_microscaled
from megafp8_kernels.microscaling_reference import e2m1_values, e8m0_values, unpack_e2m1


def _nvfp4_tensors(weight: torch.Tensor) -> list[torch.Tensor]:
    q = quantize_microscaled(weight.float(), E2M1, NVFP4_16X16, backend="reference")[0]
    per_row = q.scale_inv.repeat_interleave(16, dim=0)[:weight.shape[0]].contiguous()
    return [q.data.contiguous(), per_row, (1.0 / q.global_scale_inv.float()).reshape(1)]


def _mxfp8_tensors(weight: torch.Tensor) -> list[torch.Tensor]:
    q = quantize_microscaled(weight.float(), E4M3, MX_1X32, backend="reference")[0]
    return [q.data.contiguous(), q.scale_inv.contiguous()]


@dataclass(frozen=True)
class MicroscaledExport:
    """One --save-format: its compressed-tensors format and weight arguments, and the tensors that replace a
    ``...weight`` of shape [out, in] (suffix, shape from (out, in), dtype)."""

    compressed_format: str
    weights: dict[str, Any]
    group: int
    parts: tuple[tuple[str, Callable[[int, int], tuple[int, ...]], torch.dtype], ...]
    quantize: Callable[[torch.Tensor], list[torch.Tensor]]

    def quantization_config(self, num_layers: int, saved_args: Mapping[str, Any],
                            switched: Iterable[str] = ()) -> dict[str, Any]:
        """config.json's ``quantization_config``: the scheme on every Linear, ``ignore`` naming the linears kept in
        bf16 (``lm_head``, the layers trained in BF16, those the saturation guard switched)."""
        ignore = ["lm_head"] + [f"model.layers.{i}.{linear}" for i in bf16_layers(num_layers, saved_args)
                                for linear in HF_LAYER_LINEARS]
        ignore += [name for name in guard_switched_hf_linears(switched) if name not in ignore]
        group = {"targets": ["Linear"], "weights": self.weights, "input_activations": None,
                 "output_activations": None, "format": self.compressed_format}
        return {"quant_method": "compressed-tensors", "format": self.compressed_format,
                "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore,
                "kv_cache_scheme": None}

    def planned_tensors(self, name: str, shape: tuple[int, int]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The tensors that replace HF weight ``name`` (``...q_proj.weight``) of ``shape`` [out, in]."""
        rows, cols = shape
        if cols % self.group:
            raise ValueError(f"{name}: {self.compressed_format} groups of {self.group} need the input dimension "
                             f"({cols}) to be a multiple")
        base = name.removesuffix("weight")
        return [(base + suffix, shape_of(rows, cols), dtype) for suffix, shape_of, dtype in self.parts]


NVFP4 = MicroscaledExport(
    "nvfp4-pack-quantized",
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True, "dynamic": False,
     "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}, 16,
    (("weight_packed", lambda r, c: (r, c // 2), torch.uint8),
     ("weight_scale", lambda r, c: (r, c // 16), torch.float8_e4m3fn),
     ("weight_global_scale", lambda r, c: (1,), torch.float32)),
    _nvfp4_tensors)
MXFP8 = MicroscaledExport(
    "mxfp8-quantized",
    {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False,
     "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}, 32,
    (("weight", lambda r, c: (r, c), torch.float8_e4m3fn), ("weight_scale", lambda r, c: (r, c // 32), torch.uint8)),
    _mxfp8_tensors)
EXPORTS = {"hf-nvfp4": NVFP4, "hf-mxfp8": MXFP8}


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """What a compressed-tensors loader reconstructs from hf-nvfp4 (float32): e2m1 * weight_scale / global."""
    return e2m1_values(unpack_e2m1(packed)) * (scale.float() / global_scale.float()).repeat_interleave(16, dim=1)


def dequantize_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a loader reconstructs from hf-mxfp8 (float32): e4m3 * 2^(scale - 127)."""
    return weight.float() * e8m0_values(scale).repeat_interleave(32, dim=1)
