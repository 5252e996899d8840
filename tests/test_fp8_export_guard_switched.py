"""hf-fp8 export of a run whose FP8 saturation guard switched a layer to high precision: that layer's HF linears are
stored in bf16 (no weight_scale_inv) and named in modules_to_not_convert, as they were trained; the others stay FP8."""
import json
from types import SimpleNamespace

import pytest
import torch

from test_fp8_export_config import save_tiny_checkpoint

from megafp8.checkpoint.convert_hf import megafp8_to_hf
from megafp8.checkpoint.fp8_export import guard_switched_hf_linears

RECIPE = {"fp8_format": "hybrid", "fp8_recipe": "blockwise", "fp8_saturation_guard": True, "bf16": True}
SWITCHED = ["layers.1.mlp.linear_fc1"]


def test_guard_switched_layer_is_exported_in_bf16(tmp_path):
    from safetensors.torch import load_file

    guard = SimpleNamespace(state_dict=lambda: {"strikes": {}, "switched": SWITCHED})  # what the guard saves
    save_tiny_checkpoint(tmp_path / "m8", RECIPE, 3, num_layers=2, hidden_size=128, ffn_hidden_size=128,
                         saturation_guard=guard)
    megafp8_to_hf(tmp_path / "m8", tmp_path / "fp8", save_format="hf-fp8", progress=False)
    megafp8_to_hf(tmp_path / "m8", tmp_path / "bf16", save_dtype="bf16", progress=False)

    switched = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    hf_config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert hf_config["quantization_config"]["modules_to_not_convert"] == ["lm_head", *switched]
    stored, bf16 = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    for name in switched:
        assert stored[name + ".weight"].dtype == torch.bfloat16 and name + ".weight_scale_inv" not in stored
        assert torch.equal(stored[name + ".weight"], bf16[name + ".weight"])
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn  # the rest stays FP8
    assert stored["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    from transformers.utils.quantization_config import FineGrainedFP8Config
    assert FineGrainedFP8Config.from_dict(hf_config["quantization_config"]).modules_to_not_convert[1:] == switched


def test_guard_names_map_to_hf_linears():
    assert guard_switched_hf_linears(["layers.2.self_attention.linear_qkv", "layers.0.mlp.linear_fc2"]) == [
        "model.layers.0.mlp.down_proj", "model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.q_proj",
        "model.layers.2.self_attn.v_proj"]
    with pytest.raises(ValueError, match="output_layer"):
        guard_switched_hf_linears(["output_layer"])
