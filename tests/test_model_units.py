"""Model building blocks against independent fp64 formulas, plus config validation and initialization."""
import math

import pytest
import torch

from megafp8.model import GPTModel, ModelConfig
from megafp8.model.norm import RMSNorm
from megafp8.model.rotary import RotaryEmbedding, apply_rotary
from megafp8.parallel.parallel_state import LayoutError, ParallelState


def _single() -> ParallelState:
    return ParallelState().init_process_groups()


def test_rmsnorm_matches_fp64_formula_and_keeps_dtype():
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 3, 32) * 7
    x64 = x.double()
    expected = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.float32  # fp32 weight promotes, as in HF Llama


def test_rotary_scores_depend_only_on_relative_position():
    """RoPE's defining property: <R(m) q, R(n) k> is a function of m - n; rotations keep norms."""
    rope = RotaryEmbedding(head_dim=16, theta=10000.0, max_positions=64)
    cos, sin = rope(64)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    rotated_q = apply_rotary(q.expand(64, 1, 1, 16), cos.double(), sin.double())[:, 0, 0]
    rotated_k = apply_rotary(k.expand(64, 1, 1, 16), cos.double(), sin.double())[:, 0, 0]
    torch.testing.assert_close(rotated_q.norm(dim=-1), q.norm().expand(64))
    score = lambda m, n: (rotated_q[m] * rotated_k[n]).sum()  # noqa: E731
    torch.testing.assert_close(score(10, 3), score(40, 33), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(10, 3), score(10, 4))
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        rope(65)


def test_init_std_and_scaled_output_projections():
    config = ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                         init_method_std=0.02)
    torch.manual_seed(0)
    model = GPTModel(config, _single())
    scaled = 0.02 / math.sqrt(2 * 8)
    for name, param in model.named_parameters():
        if "layernorm" in name:
            assert torch.all(param == 1), name
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert param.std().item() == pytest.approx(scaled, rel=0.05), name
        elif name in ("embedding.weight", "output_layer.weight"):  # vocab padding rows are zero
            assert torch.all(param[config.vocab_size:] == 0), name
            assert param[: config.vocab_size].std().item() == pytest.approx(0.02, rel=0.05), name
        else:
            assert param.std().item() == pytest.approx(0.02, rel=0.05), name


def test_logits_and_loss_shapes():
    config = ModelConfig(make_vocab_size_divisible_by=32)
    model = GPTModel(config, _single())
    ids = torch.randint(0, config.vocab_size, (3, config.seq_length))
    assert model(ids).shape == (3, config.seq_length, 128)
    loss = model(ids, labels=ids)
    assert loss.shape == (3, config.seq_length) and loss.dtype == torch.float32
    assert loss.mean().item() == pytest.approx(math.log(config.vocab_size), rel=0.1)  # near-uniform at init


def test_smooth_swiglu_equals_swiglu_in_high_precision():
    """Smooth-SwiGLU only rescales the FP8 quantization of fc2's input; in fp32 it is SwiGLU."""
    ids = torch.randint(0, 100, (2, 16))
    outputs = []
    for activation in ("swiglu", "smooth_swiglu"):
        torch.manual_seed(0)
        outputs.append(GPTModel(ModelConfig(activation=activation), _single())(ids))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--activation"):
        ModelConfig(activation="gelu")
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        ModelConfig(seq_length=64, max_position_embeddings=32)


def test_model_rejects_bad_layout_before_allocating():
    """GPTModel validates first: 6 heads on TP=4 must name the flag, not fail in a reshape."""
    ps = ParallelState(world_size=4, tensor_model_parallel_size=4)  # groups never built: no compute possible
    config = ModelConfig(hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=64)
    with pytest.raises(LayoutError, match="--num-attention-heads") as err:
        GPTModel(config, ps)
    assert "hidden_size=48" in str(err.value) and "world size 4" in str(err.value)
