"""hf-nvfp4 export: an NVFP4-trained checkpoint written in the compressed-tensors layout (nvfp4-pack-quantized,
NVFP4A16: E2M1 weights packed two per byte, E4M3 scales per 16, an fp32 global scale), which the real readers load:
compressed-tensors parses the ``quantization_config``, and transformers (with compressed-tensors installed)
decompresses the weights and runs the model. The stored values are the weights the NVFP4 recipe trains with (16x16
tiles under TransformerEngine's scale chain), layers kept in BF16 stay bf16 and are listed in ``ignore``."""
import json

import torch

from convert_testing import convert
from test_fp8_export_config import LINEARS, save_tiny_checkpoint

from megafp8.checkpoint.convert_hf import megafp8_to_hf
from megafp8.checkpoint.nvfp4_export import dequantize_weight
from megafp8_kernels.formats import E2M1, NVFP4_16X16
from megafp8_kernels.microscaling import quantize_microscaled

RECIPE = {"fp8_format": "e4m3", "fp8_recipe": "nvfp4", "first_last_layers_bf16": 1, "bf16": True}


def test_hf_nvfp4_export_is_read_by_compressed_tensors_and_transformers(tmp_path):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    save_tiny_checkpoint(tmp_path / "m", RECIPE, 5, num_layers=3, hidden_size=64, ffn_hidden_size=128)
    result = convert("--load-format", "megafp8", "--save-format", "hf-nvfp4", "--load-dir", tmp_path / "m",
                     "--save-dir", tmp_path / "nvfp4")
    assert result.returncode == 0, result.stderr
    megafp8_to_hf(tmp_path / "m", tmp_path / "fp32", save_dtype="fp32", progress=False)
    megafp8_to_hf(tmp_path / "m", tmp_path / "bf16", save_dtype="bf16", progress=False)

    hf_config = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(hf_config["quantization_config"])
    scheme = parsed.config_groups["group_0"]
    assert parsed.format == "nvfp4-pack-quantized" and scheme.weights.group_size == 16 and scheme.weights.num_bits == 4
    assert scheme.input_activations is None  # NVFP4A16: the activations are the serving stack's
    assert parsed.ignore == ["lm_head"] + [f"model.layers.{i}.{linear}" for i in (0, 2) for linear in LINEARS]
    assert hf_config["megafp8_training_recipe"]["fp8_recipe"] == "nvfp4"

    stored, fp32, bf16 = (load_file(tmp_path / d / "model.safetensors") for d in ("nvfp4", "fp32", "bf16"))
    quantized = {f"model.layers.1.{linear}." for linear in LINEARS}
    assert {n.removesuffix("weight_packed") for n in stored if n.endswith("weight_packed")} == quantized
    ours = {}
    for base in quantized:
        packed, scale, global_scale = (stored[base + s] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        weight = fp32[base + "weight"]
        assert packed.dtype == torch.uint8 and packed.shape == (weight.shape[0], weight.shape[1] // 2)
        assert scale.dtype == torch.float8_e4m3fn and global_scale.shape == (1,)
        ours[base] = dequantize_weight(packed, scale, global_scale)
        trained = quantize_microscaled(weight, E2M1, NVFP4_16X16)[0].dequantize()  # what the recipe's fprop reads
        torch.testing.assert_close(ours[base], trained, rtol=2**-22, atol=0)
    for name, value in stored.items():  # everything else: the bf16 export's tensors
        if not any(name.startswith(base) for base in quantized):
            assert torch.equal(value, bf16[name]), name

    # transformers + compressed-tensors: the dense weights (decompressed in bf16) and the model's logits.
    loaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "nvfp4", torch_dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    state = loaded.state_dict()
    for base, weight in ours.items():
        assert torch.allclose(state[base + "weight"].float(), weight, rtol=2**-7, atol=0), base
    unquantized = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32", torch_dtype=torch.float32)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32", torch_dtype=torch.float32)
    reference.load_state_dict({**reference.state_dict(), **{base + "weight": w for base, w in ours.items()}})
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, plain = loaded(ids).logits, reference(ids).logits, unquantized(ids).logits
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # transformers decompresses in bf16 (each weight within 2^-8 relative of ours); the NVFP4 error itself is larger.
    assert rel(got, want) < 1e-2 and rel(got, want) < rel(got, plain) / 2, (rel(got, want), rel(got, plain))
