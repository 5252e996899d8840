"""128x128 block-scaled E4M3 weights, the layout of DeepSeek-V3-style FP8 checkpoints (``weight`` in
float8_e4m3fn plus a float32 ``weight_scale_inv`` of shape [ceil(out/128), ceil(in/128)], where
``weight ≈ fp8.float() * weight_scale_inv`` expanded block-wise), and the ``config.json`` fields that describe it."""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from megafp8.checkpoint.errors import CheckpointError
from megafp8.checkpoint.safe_dcp import entry_source

BLOCK = 128
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
# the HF Llama linears of a decoder layer (``model.layers.N.<module>``) that the export may store in FP8
HF_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# the training flags that say how the weights were trained (their names in the manifest and the training entry)
RECIPE_FLAGS = ("fp8_format", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin",
                "fp8_power_of_2_scale", "first_last_layers_bf16", "fp8_param_gather", "fp4_param_gather",
                "fp8_saturation_guard", "bf16",
                "activation", "master_weight_dtype", "optimizer_state_dtype")
RECIPE_KEY = "megafp8_training_recipe"  # config.json key; transformers keeps unknown keys through save_pretrained
# megafp8's FP8 linears (the saturation guard's layer names) -> the HF linears they become
HF_LINEARS_OF = {"self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attention.linear_proj": ("self_attn.o_proj",),
                 "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp.linear_fc2": ("mlp.down_proj",)}
_GUARD_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(k) for k in HF_LINEARS_OF) + r")$")


def bf16_layers(num_layers: int, saved_args: Mapping[str, Any]) -> list[int]:
    """The decoder layers the run kept in BF16 (``--first-last-layers-bf16 N``: the first and last N, also under
    FP8); the export keeps their linears in bf16 too, so it does not quantize what training never did."""
    keep = saved_args.get("first_last_layers_bf16") or 0
    if not saved_args.get("fp8_format") or not isinstance(keep, int) or keep <= 0:
        return []
    return sorted(set(range(min(keep, num_layers))) | set(range(max(num_layers - keep, 0), num_layers)))


def guard_switched_hf_linears(switched: Iterable[str]) -> list[str]:
    """The HF module names of the layers the FP8 saturation guard switched to high precision (its state's
    ``switched``: megafp8 module names such as ``layers.3.mlp.linear_fc1``), in layer order."""
    names = []
    for layer in switched:
        match = _GUARD_LAYER.search(layer)
        if match is None:
            raise ValueError(f"saturation guard state names {layer!r}, which is not a decoder layer's FP8 linear")
        names += [f"model.layers.{match[1]}.{linear}" for linear in HF_LINEARS_OF[match[2]]]
    return sorted(set(names), key=lambda n: (int(n.split(".")[2]), n))


def read_guard_switched(checkpoint: Path, index: Metadata) -> list[str]:
    """Every saved rank's guard-switched layers in a committed checkpoint (save_checkpoint's ``fp8_guard``), read
    as plain data only; ``index``: its DCP metadata (``safe_dcp.read_metadata``)."""
    from megafp8.checkpoint.save_load import _from_bytes, read_entries  # the checkpoint's own formats

    keys = sorted(key for key in index.state_dict_metadata if key.startswith("fp8_guard."))
    if not keys:
        return []
    state = {"fp8_guard": {key.split(".")[1]: b"" for key in keys}}
    read_entries(state, checkpoint)
    switched = set()
    for key in keys:
        source = entry_source(checkpoint, index, MetadataIndex(key))
        names = _from_bytes(state["fp8_guard"][key.split(".")[1]], source).get("switched", [])
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise CheckpointError(f"{source}: 'switched' is not a list of layer names")
        switched.update(names)
    return sorted(switched)


def fp8_linear_names(num_layers: int, saved_args: Mapping[str, Any], switched: Iterable[str] = ()) -> set[str]:
    """The HF module names (``model.layers.N.self_attn.q_proj`` ...) stored in block FP8: not those of the layers
    trained in BF16, nor of those the saturation guard switched to high precision (``switched``, its names)."""
    kept = set(bf16_layers(num_layers, saved_args))
    names = {f"model.layers.{i}.{linear}" for i in range(num_layers) if i not in kept for linear in HF_LAYER_LINEARS}
    return names - set(guard_switched_hf_linears(switched))


def quantization_config(num_layers: int, saved_args: Mapping[str, Any], switched: Iterable[str] = ()) -> dict[str, Any]:
    """config.json's ``quantization_config``: DeepSeek-V3's fields, plus ``modules_to_not_convert`` naming every
    linear kept in bf16 (``lm_head``, the layers the run trained in BF16 and those the saturation guard switched),
    which transformers' FineGrainedFP8Config reads (and vLLM's Fp8Config when it finds no ``ignored_layers``)."""
    kept = ["lm_head"] + [f"model.layers.{i}.{linear}" for i in bf16_layers(num_layers, saved_args)
                          for linear in HF_LAYER_LINEARS]
    kept += [name for name in guard_switched_hf_linears(switched) if name not in kept]
    return {**QUANTIZATION_CONFIG, "modules_to_not_convert": kept}


def training_recipe(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``megafp8_training_recipe``: the checkpoint's iteration and the precision flags it was trained
    with, from its manifest (a checkpoint converted from another format has none of them: only the iteration)."""
    saved = manifest.get("args", {})
    return {"iteration": manifest.get("iteration", 0), **{k: saved[k] for k in RECIPE_FLAGS if k in saved}}


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
