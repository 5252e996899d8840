"""GPTModel (TP=1, fp32) equals transformers.LlamaForCausalLM on the same weights: pins the architecture
(norm placement, RoPE convention, GQA head grouping, SwiGLU order, tying) to the real Llama."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megafp8.model import GPTModel, ModelConfig  # noqa: E402
from megafp8.model.hf_mapping import (  # noqa: E402
    from_hf_state_dict,
    hf_llama_config_kwargs,
    model_config_from_hf,
    to_hf_state_dict,
)
from megafp8.parallel.parallel_state import ParallelState  # noqa: E402

# fp32 end to end; both sides use the same math, so only summation order differs (~1e-7 observed).
TOLERANCE = 1e-5


def _config(num_query_groups: int, tie: bool) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=num_query_groups, seq_length=16, max_position_embeddings=32, vocab_size=100,
                       make_vocab_size_divisible_by=16, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=tie)


def _hf_model(config: ModelConfig) -> "transformers.LlamaForCausalLM":
    hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(config), attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_config).eval()


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _batch(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("num_query_groups, tie", [(2, False), (2, True), (4, False), (1, True)],
                         ids=["gqa", "gqa-tied", "mha", "mqa-tied"])
def test_megafp8_weights_in_hf_llama_give_same_logits(num_query_groups, tie):
    config = _config(num_query_groups, tie)
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState().init_process_groups())
    with torch.no_grad():  # norms start at 1; random values make a swapped norm mapping visible
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    hf = _hf_model(config)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), config), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if tie else [])
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie

    ids = _batch(config)
    with torch.no_grad():
        ours = model(ids)[..., : config.vocab_size]
        theirs = hf(ids).logits
        assert _rel_err(ours, theirs) <= TOLERANCE
        loss = model(ids, labels=ids)
    reference_loss = F.cross_entropy(theirs.reshape(-1, config.vocab_size), ids.reshape(-1), reduction="none")
    assert _rel_err(loss.reshape(-1), reference_loss) <= TOLERANCE


def test_hf_llama_weights_load_into_megafp8():
    """The direction a checkpoint import takes: HF init -> from_hf_state_dict -> GPTModel."""
    config = _config(num_query_groups=2, tie=False)
    torch.manual_seed(1)
    hf = _hf_model(config)
    model = GPTModel(config, ParallelState().init_process_groups())
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    ids = _batch(config)
    with torch.no_grad():
        assert _rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    # and back: the round trip is exact
    back = to_hf_state_dict(model.state_dict(), config)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_model_config_from_hf_config_roundtrip():
    config = _config(num_query_groups=2, tie=True)
    hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(config))
    back = model_config_from_hf(hf_config, seq_length=config.seq_length,
                                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by)
    assert back == config
