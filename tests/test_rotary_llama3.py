"""Llama-3.1 RoPE frequency scaling: the frequencies against Meta's reference loop in fp64 and, bit for bit,
against transformers' ``llama3`` RoPE; the cos/sin tables against transformers' LlamaRotaryEmbedding; the
flags, config.json spellings and refusals (each naming its flag or field); resuming with other values."""
import math
from types import SimpleNamespace

import pytest
import torch

from megafp8.checkpoint.args_check import ArgsMismatchError, check_args
from megafp8.checkpoint.hf_files import ConversionError, model_config_from_hf_dict
from megafp8.model.config import ModelConfig
from megafp8.model.rotary import Llama3RopeScaling, RotaryEmbedding, rope_inv_freq
from megafp8.training.arguments import ArgumentError, parse_args
from megafp8.training.megatron_flags import LLAMA_FLAGS

transformers = pytest.importorskip("transformers")

# (head_dim, rope_theta, scaling): Llama-3.1-8B, Llama-3.2-1B, and a test-sized model whose three bands
# (kept, smoothed, divided) all fall inside head_dim 16 because its original length is only 64.
CASES = {"llama-3.1-8b": (128, 500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
         "llama-3.2-1b": (64, 500000.0, Llama3RopeScaling(32.0, 1.0, 4.0, 8192)),
         "tiny": (16, 500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 64))}


def _meta_reference(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> list[float]:
    """Meta's llama-models ``apply_scaling``, one frequency at a time, in Python (fp64) floats."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for freq in inv_freq.double().tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


def _hf_config(head_dim: int, theta: float, s: Llama3RopeScaling, max_positions: int = 256):
    return transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                                    max_position_embeddings=max_positions,
                                    rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": s.factor,
                                                     "low_freq_factor": s.low_freq_factor,
                                                     "high_freq_factor": s.high_freq_factor,
                                                     "original_max_position_embeddings":
                                                         s.original_max_position_embeddings})


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_frequencies_match_meta_and_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, scaling = CASES[case]
    unscaled = rope_inv_freq(head_dim, theta)
    ours = rope_inv_freq(head_dim, theta, scaling)
    expected = torch.tensor(_meta_reference(unscaled, scaling), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, rtol=4e-7, atol=0)  # fp32 rounding of the same formula
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(head_dim, theta, scaling), "cpu")
    assert attention_factor == 1.0 and torch.equal(ours, hf_inv_freq)
    # every band is exercised: kept, divided by the factor, smoothed in between
    ratio = unscaled / ours
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(scaling.factor)).any()
    assert ((ratio > 1.001) & (ratio < scaling.factor * 0.999)).any()


def test_cos_sin_tables_match_transformers_past_the_original_length():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, scaling = CASES["tiny"]
    positions = 256  # 4x the original 64: where the divided band's angles matter
    ours = RotaryEmbedding(head_dim, theta, positions, scaling=scaling)
    hf = LlamaRotaryEmbedding(_hf_config(head_dim, theta, scaling, positions))
    x = torch.zeros(1, positions, head_dim)
    hf_cos, hf_sin = hf(x, torch.arange(positions)[None])
    cos, sin = ours(positions)
    torch.testing.assert_close(cos[:, 0, 0], hf_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0, 0], hf_sin[0], rtol=0, atol=2e-6)
    unscaled_cos, _ = RotaryEmbedding(head_dim, theta, positions)(positions)
    assert (unscaled_cos - cos).abs().max() > 0.5  # the scaling moves the long wavelengths a lot


def _argv(*extra: str) -> list[str]:
    return [*LLAMA_FLAGS, "--data-path", "unused", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
            "--train-iters", "1", *extra]


def test_flags_build_the_scaled_config_and_bad_values_name_the_flag():
    from megafp8.training.model_setup import model_config_from_args

    args = parse_args(_argv("--use-rope-scaling", "--rope-scaling-factor", "32",
                            "--rope-scaling-original-max-position-embeddings", "64"))
    assert model_config_from_args(args, 10).rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 64)
    assert model_config_from_args(parse_args(_argv()), 10).rope_scaling is None
    with pytest.raises(ArgumentError, match="--rope-scaling-factor 32.0 needs --use-rope-scaling"):
        parse_args(_argv("--rope-scaling-factor", "32"))
    with pytest.raises(ArgumentError, match=r"--rope-scaling-high-freq-factor \(1.0\) must exceed "
                                            r"--rope-scaling-low-freq-factor \(1.0\)"):
        parse_args(_argv("--use-rope-scaling", "--rope-scaling-high-freq-factor", "1"))
    with pytest.raises(ArgumentError, match="--rope-scaling-original-max-position-embeddings must be positive"):
        parse_args(_argv("--use-rope-scaling", "--rope-scaling-original-max-position-embeddings", "0"))
    with pytest.raises(ValueError, match="--rope-scaling-factor must be positive"):
        ModelConfig(use_rope_scaling=True, rope_scaling_factor=0.0)


def test_resuming_with_other_scaling_is_refused_unless_finetune():
    saved = {"use_rope_scaling": True, "rope_scaling_factor": 8.0}
    with pytest.raises(ArgsMismatchError, match="--rope-scaling-factor: checkpoint 8.0, now 32.0"):
        check_args(saved, {"use_rope_scaling": True, "rope_scaling_factor": 32.0})
    check_args(saved, {"use_rope_scaling": True, "rope_scaling_factor": 32.0}, finetune=True)


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 131072, "rope_theta": 500000.0}
META_31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
           "rope_type": "llama3"}  # Llama-3.1-8B's config.json, verbatim


@pytest.mark.parametrize("spelling", ["meta rope_scaling", "transformers-5 rope_parameters", "old 'type' key"])
def test_config_json_spellings_of_llama3_scaling(spelling):
    rope = {"meta rope_scaling": {"rope_scaling": META_31},
            "transformers-5 rope_parameters": {"rope_parameters": {**META_31, "rope_theta": 500000.0}},
            "old 'type' key": {"rope_scaling": {**{k: v for k, v in META_31.items() if k != "rope_type"},
                                                "type": "llama3"}}}[spelling]
    config = model_config_from_hf_dict({**LLAMA, **rope}, "config.json")
    assert config.rope_theta == 500000.0 and config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_missing_original_length_defaults_to_max_position_embeddings_as_transformers():
    rope = {k: v for k, v in META_31.items() if k != "original_max_position_embeddings"}
    config = model_config_from_hf_dict({**LLAMA, "rope_scaling": rope}, "config.json")
    assert config.rope_scaling.original_max_position_embeddings == 131072
    assert model_config_from_hf_dict({**LLAMA, "rope_scaling": {"rope_type": "default"}}, "c").rope_scaling is None


REFUSED = {
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type='linear'"),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    "llama3 without factor": ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0}},
                              "rope_scaling with rope_type 'llama3' lacks factor"),
    "llama3 high <= low": ({"rope_scaling": {**META_31, "high_freq_factor": 1.0}},
                           "rope_scaling.high_freq_factor (1.0) must exceed rope_scaling.low_freq_factor (1.0)"),
    "partial rotary": ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
                       "rope_parameters.partial_rotary_factor=0.5"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_rope_types_are_refused_naming_the_field(case):
    fields, message = REFUSED[case]
    with pytest.raises(ConversionError) as error:
        model_config_from_hf_dict({**LLAMA, **fields}, "hf/config.json")
    assert str(error.value).startswith("hf/config.json: unsupported config field(s)") and message in str(error.value)


def test_model_config_from_a_transformers_object_refuses_too():
    from megafp8.model.hf_mapping import model_config_from_hf

    hf = SimpleNamespace(**{**LLAMA, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                            "initializer_range": 0.02, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'"):
        model_config_from_hf(hf)
