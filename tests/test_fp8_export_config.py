"""hf-fp8 export describes itself: config.json's ``quantization_config`` is what transformers' FineGrainedFP8Config
and DeepSeek-V3-style loaders read (quant_method "fp8", fmt, dynamic activations, 128x128 weight blocks,
``modules_to_not_convert`` = lm_head plus the layers the run kept in BF16 under ``--first-last-layers-bf16``,
stored in bf16), and ``megafp8_training_recipe`` holds the run's FP8 flags from the checkpoint manifest.
transformers loads the export on CPU and dequantizes it when accelerate is installed; without accelerate it
refuses (the message is checked), and the weights are read back with safetensors and dequantized here in fp64.
Either way every dequantized weight matches the bf16 export within the E4M3 block bound."""
import importlib.util
import json

import pytest
import torch

from convert_testing import convert

from megafp8.checkpoint import save_checkpoint
from megafp8.checkpoint.convert_hf import megafp8_to_hf, training_args
from megafp8.model import GPTModel
from megafp8.model.config import ModelConfig
from megafp8.parallel.parallel_state import ParallelState

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
RECIPE = {"fp8_format": "hybrid", "fp8_recipe": "blockwise", "fp8_amax_history_len": 16,
          "fp8_amax_compute_algo": "max", "fp8_margin": 0, "first_last_layers_bf16": 1, "bf16": True}


def _e4m3_block_bound(dequantized: torch.Tensor, bf16: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """Round-to-nearest E4M3 of the fp32 weight (<= 2^-4 relative, <= 2^-10 of the block scale for subnormals),
    plus the bf16 roundings of the export and of a bf16 dequantization (2^-9 relative each)."""
    scale = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:bf16.shape[0], :bf16.shape[1]]
    reference = bf16.double()
    return bool(torch.all((dequantized.double() - reference).abs() <= reference.abs() * (2**-4 + 2**-7)
                          + scale * 2**-10))


def _dequantize_fp64(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    scale = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.double() * scale[:weight.shape[0], :weight.shape[1]]


def save_tiny_checkpoint(directory, recipe, iteration, num_layers, hidden_size, ffn_hidden_size, **save_kw):
    """A megafp8 checkpoint of a fresh tiny model saved with these training flags."""
    config = ModelConfig(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                         num_attention_heads=2, num_query_groups=1, vocab_size=100, seq_length=16,
                         max_position_embeddings=32)
    torch.manual_seed(0)
    single = ParallelState().init_process_groups()
    save_checkpoint(directory, iteration, model=GPTModel(config, single), parallel_state=single,
                    args={**training_args(config), "seq_length": 16, **recipe}, **save_kw)


def test_hf_fp8_export_is_self_describing_and_loads(tmp_path):
    from safetensors.torch import load_file

    # 3 layers (layers 0 and 2 trained in BF16), several 128x128 blocks per weight; whole blocks, because
    # transformers 5.24's CPU dequantization takes the block as rows // scale_rows (docs/conversion.md)
    save_tiny_checkpoint(tmp_path / "m8", RECIPE, 7, num_layers=3, hidden_size=256, ffn_hidden_size=384)
    result = convert("--load-format", "megafp8", "--save-format", "hf-fp8", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "fp8")
    assert result.returncode == 0, result.stderr
    megafp8_to_hf(tmp_path / "m8", tmp_path / "bf16", save_dtype="bf16", progress=False)

    hf_config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    kept = ["lm_head"] + [f"model.layers.{i}.{linear}" for i in (0, 2) for linear in LINEARS]
    assert hf_config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [128, 128], "modules_to_not_convert": kept}
    assert hf_config["megafp8_training_recipe"] == {"iteration": 7, "activation": "swiglu", **RECIPE}
    from transformers.utils.quantization_config import FineGrainedFP8Config
    parsed = FineGrainedFP8Config.from_dict(hf_config["quantization_config"])
    assert parsed.quant_method == "fp8" and tuple(parsed.weight_block_size) == (128, 128)
    assert parsed.activation_scheme == "dynamic" and parsed.modules_to_not_convert == kept

    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    fp8_names = {f"model.layers.1.{linear}.weight" for linear in LINEARS}
    assert {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn} == fp8_names
    assert {n.removesuffix("_scale_inv") for n in stored if n.endswith("_scale_inv")} == fp8_names
    assert stored["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 3)

    import transformers
    readers = {"safetensors + fp64 dequantization": {
        name: _dequantize_fp64(stored[name], stored[name + "_scale_inv"]) if name in fp8_names else value
        for name, value in stored.items() if not name.endswith("_scale_inv")}}
    if importlib.util.find_spec("accelerate") is None:  # transformers refuses an FP8 config without accelerate
        with pytest.raises(ImportError, match=r"Loading an FP8 quantized model requires accelerate"):
            transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp8")
    else:  # on CPU transformers dequantizes the FP8 weights to bf16 while loading
        readers["transformers"] = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp8").state_dict()
    for reader, loaded in readers.items():
        assert sorted(loaded) == sorted(bf16), reader
        for name, reference in bf16.items():
            if name in fp8_names:
                assert _e4m3_block_bound(loaded[name], reference, stored[name + "_scale_inv"]), (reader, name)
                assert not torch.equal(loaded[name].to(torch.bfloat16), reference), (reader, name)  # quantized
            else:  # embeddings, norms, lm_head and the BF16-trained layers: the bf16 export's exact tensors
                assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], reference), (reader, name)
