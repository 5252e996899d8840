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
