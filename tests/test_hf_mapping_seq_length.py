"""An imported HF config gets a sane default seq_length (not Llama-3.1's 131072 positions); RoPE keeps them all."""
from types import SimpleNamespace

import pytest

from megafp8.checkpoint.hf_files import model_config_from_hf_dict
from megafp8.model.hf_mapping import DEFAULT_HF_SEQ_LENGTH, model_config_from_hf

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 100, "rope_theta": 500000.0}


@pytest.mark.parametrize("positions,expected", [(131072, DEFAULT_HF_SEQ_LENGTH), (2048, 2048)])
def test_default_seq_length_is_capped_and_positions_kept(positions, expected):
    config = model_config_from_hf_dict({**LLAMA, "max_position_embeddings": positions}, "config.json")
    assert config.seq_length == expected and config.max_position_embeddings == positions


def test_explicit_seq_length_is_kept():
    fields = dict(LLAMA, max_position_embeddings=131072, num_key_value_heads=4, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.02)
    config = model_config_from_hf(SimpleNamespace(**fields), seq_length=8192)
    assert config.seq_length == 8192 and config.max_position_embeddings == 131072
