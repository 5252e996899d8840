"""The FLOP formula equals what torch's FlopCounterMode counts in the model's real forward + backward."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.flops import flops_per_iteration


@pytest.mark.parametrize("kv_channels", [None, 24], ids=["d=h/heads", "kv-channels"])
def test_formula_equals_counted_flops_of_the_model(kv_channels):
    config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                         num_query_groups=2, seq_length=32, vocab_size=200, make_vocab_size_divisible_by=64,
                         kv_channels=kv_channels)
    model = GPTModel(config, ParallelState().init_process_groups())
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    # The math backend runs attention as two batched GEMMs the counter sees (CPU's fused kernel has no formula).
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, labels=tokens).mean().backward()
    expected = flops_per_iteration(3, num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                                   num_query_groups=2, seq_length=32, padded_vocab_size=model.padded_vocab_size,
                                   kv_channels=kv_channels)
    # FlopCounterMode counts the GEMMs and SDPA (full s x s, like the formula) and nothing elementwise.
    # The embedding has no GEMM in the formula nor in the count; its backward is a scatter-add.
    assert counter.get_total_flops() == expected


def test_moe_formula_counts_what_a_token_runs():
    """Router, k experts per token and the shared expert, as Megatron counts a MoE layer (dropless, every expert
    busy: an idle expert would run one zero row)."""
    config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, seq_length=32,
                         vocab_size=200, make_vocab_size_divisible_by=64, num_experts=4, moe_router_topk=2,
                         moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32, moe_layer_freq="0,1")
    model = GPTModel(config, ParallelState().init_process_groups())
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, labels=tokens).mean().backward()
    assert min(model.layers["1"].mlp.stats["tokens_per_expert"].tolist()) > 0
    expected = flops_per_iteration(3, num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                                   num_query_groups=4, seq_length=32, padded_vocab_size=model.padded_vocab_size,
                                   num_moe_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                   moe_shared_expert_intermediate_size=32)
    assert counter.get_total_flops() == expected
