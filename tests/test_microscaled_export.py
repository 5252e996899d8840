"""hf-nvfp4 and hf-mxfp8 exports: NVFP4- and MXFP8-trained checkpoints written in the compressed-tensors layouts
(nvfp4-pack-quantized / NVFP4A16, mxfp8-quantized / MXFP8A16), which the real readers load: compressed-tensors parses
the ``quantization_config``, and transformers (with compressed-tensors installed) decompresses the weights and runs
the model. The stored values are the weights the recipe's forward GEMM reads; layers kept in BF16 stay bf16 and are
listed in ``ignore``."""
import json

import pytest
import torch

from convert_testing import convert
from test_fp8_export_config import LINEARS, save_tiny_checkpoint

from megafp8.checkpoint.convert_hf import megafp8_to_hf
from megafp8.checkpoint.microscaled_export import dequantize_mxfp8, dequantize_nvfp4
from megafp8_kernels.formats import E2M1, E4M3, MX_1X32, NVFP4_16X16
from megafp8_kernels.microscaling import quantize_microscaled

CASES = {  # save format: (recipe flags, compressed-tensors format, bits, the tensors of one linear, dequantize,
    #                       the recipe's weight quantization, rtol of ours vs the recipe's values)
    "hf-nvfp4": ("nvfp4", "nvfp4-pack-quantized", 4, ("weight_packed", "weight_scale", "weight_global_scale"),
                 dequantize_nvfp4, (E2M1, NVFP4_16X16), 2**-22),
    "hf-mxfp8": ("mxfp8", "mxfp8-quantized", 8, ("weight", "weight_scale"), dequantize_mxfp8, (E4M3, MX_1X32), 0),
}


@pytest.mark.parametrize("save_format", sorted(CASES))
def test_microscaled_export_is_read_by_compressed_tensors_and_transformers(save_format, tmp_path):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    recipe, compressed_format, bits, parts, dequantize, (fmt, layout), rtol = CASES[save_format]
    flags = {"fp8_format": "e4m3", "fp8_recipe": recipe, "first_last_layers_bf16": 1, "bf16": True}
    save_tiny_checkpoint(tmp_path / "m", flags, 5, num_layers=3, hidden_size=64, ffn_hidden_size=128)
    result = convert("--load-format", "megafp8", "--save-format", save_format, "--load-dir", tmp_path / "m",
                     "--save-dir", tmp_path / "export")
    assert result.returncode == 0, result.stderr
    megafp8_to_hf(tmp_path / "m", tmp_path / "fp32", save_dtype="fp32", progress=False)
    megafp8_to_hf(tmp_path / "m", tmp_path / "bf16", save_dtype="bf16", progress=False)

    hf_config = json.loads((tmp_path / "export" / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(hf_config["quantization_config"])
    scheme = parsed.config_groups["group_0"]
    assert parsed.format == compressed_format and scheme.weights.num_bits == bits
    assert scheme.input_activations is None  # weights only: the activations are the serving stack's
    assert parsed.ignore == ["lm_head"] + [f"model.layers.{i}.{linear}" for i in (0, 2) for linear in LINEARS]
    assert hf_config["megafp8_training_recipe"]["fp8_recipe"] == recipe

    stored, fp32, bf16 = (load_file(tmp_path / d / "model.safetensors") for d in ("export", "fp32", "bf16"))
    quantized = {f"model.layers.1.{linear}." for linear in LINEARS}
    ours = {}
    for base in quantized:
        ours[base] = dequantize(*(stored[base + part] for part in parts))
        trained = quantize_microscaled(fp32[base + "weight"], fmt, layout)[0].dequantize()  # the fprop operand
        torch.testing.assert_close(ours[base], trained, rtol=rtol, atol=0)
    for name, value in stored.items():  # everything else: the bf16 export's tensors
        if not any(name.startswith(base) for base in quantized):
            assert torch.equal(value, bf16[name]), name

    # transformers + compressed-tensors: the dense weights (decompressed in bf16) and the model's logits.
    loaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "export", torch_dtype=torch.float32,
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
    # transformers decompresses in bf16 (each weight within 2^-8 relative of ours); the format's own error is larger.
    assert rel(got, want) < 1e-2 and rel(got, want) < rel(got, plain) / 2, (rel(got, want), rel(got, plain))
