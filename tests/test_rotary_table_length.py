"""RoPE tables sized to the run (--seq-length), grown on a longer forward: bit for bit the values of a table built
for max_position_embeddings (with and without Llama-3.1 scaling), on the tables' device, under
torch.compile(fullgraph) and inference_mode, fp32 through a model cast; past the limit one error naming the flag."""
import pytest
import torch

from megafp8.model import GPTModel, ModelConfig
from megafp8.model.rotary import Llama3RopeScaling, RotaryEmbedding
from megafp8.parallel.parallel_state import ParallelState

LLAMA31_8B = dict(head_dim=128, theta=500000.0, max_positions=131072)


@pytest.mark.parametrize("scaling", [None, Llama3RopeScaling()], ids=["unscaled", "llama3"])
def test_grown_table_equals_the_full_table_bit_for_bit(scaling):
    full = RotaryEmbedding(**LLAMA31_8B, scaling=scaling)
    rope = RotaryEmbedding(**LLAMA31_8B, scaling=scaling, positions=4096)
    assert rope.cos.shape == (4096, 128)  # 4 MiB for cos + sin, not 128 MiB
    for seq_len in (100, 4096, 5001, 70000, 131072):  # within, at, then past the table; up to the limit
        cos, sin = rope(seq_len)
        assert rope.cos.shape[0] == max(4096, seq_len)
        assert torch.equal(cos, full.cos[:seq_len, None, None, :])
        assert torch.equal(sin, full.sin[:seq_len, None, None, :])
    with pytest.raises(ValueError, match=r"131073 tokens exceeds --max-position-embeddings \(131072\)"):
        rope(131073)


def test_model_builds_tables_for_seq_length_and_a_longer_forward_matches_a_full_table_model():
    def model(seq_length):
        cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                          seq_length=seq_length, max_position_embeddings=64, vocab_size=50, seed=5,
                          use_rope_scaling=True, rope_scaling_original_max_position_embeddings=16)
        return GPTModel(cfg, ParallelState().init_process_groups())

    short, full = model(8), model(64)
    assert short.rotary.cos.shape[0] == 8 and full.rotary.cos.shape[0] == 64
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(short(ids), full(ids))
        with pytest.raises(ValueError, match="--max-position-embeddings"):
            short(torch.zeros(1, 65, dtype=torch.long))


def test_growth_under_torch_compile_fullgraph():
    rope, full = RotaryEmbedding(16, 10000.0, 64, positions=8), RotaryEmbedding(16, 10000.0, 64)

    def rotate(x):
        cos, sin = rope(x.shape[0])
        return x * cos + sin

    compiled = torch.compile(rotate, backend="aot_eager", fullgraph=True)
    x = torch.randn(40, 1, 1, 16)
    torch.testing.assert_close(compiled(x), x * full.cos[:40, None, None] + full.sin[:40, None, None], rtol=0, atol=0)
    assert torch.equal(rope.cos, full.cos[:40])


def test_table_grown_in_inference_mode_serves_a_later_backward():
    rope = RotaryEmbedding(16, 10000.0, 64, positions=8)
    with torch.inference_mode():  # an evaluation at a longer length grows the table
        rope(32)
    x = torch.randn(32, 1, 1, 16, requires_grad=True)
    cos, _ = rope(32)
    (x * cos).sum().backward()  # an inference tensor here would refuse to be saved for backward
    assert torch.equal(x.grad, cos.expand_as(x))


def test_model_cast_keeps_fp32_tables_and_frequencies():
    rope = RotaryEmbedding(16, 500000.0, 64, scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16), positions=8)
    full = RotaryEmbedding(16, 500000.0, 64, scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16))
    rope.bfloat16()
    assert {b.dtype for b in rope.buffers()} == {torch.float32}
    assert torch.equal(rope(64)[0], full(64)[0])  # grown from unrounded frequencies


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", [None, Llama3RopeScaling()], ids=["unscaled", "llama3"])
def test_table_grows_on_its_cuda_device_bit_for_bit(scaling):
    with torch.device("cuda"):
        full = RotaryEmbedding(**LLAMA31_8B, scaling=scaling)
        rope = RotaryEmbedding(**LLAMA31_8B, scaling=scaling, positions=4096)
    cos, sin = rope(70000)
    assert cos.device.type == "cuda" and rope.inv_freq.device.type == "cuda"
    assert torch.equal(cos, full.cos[:70000, None, None, :]) and torch.equal(sin, full.sin[:70000, None, None, :])
