"""Megatron-LM legacy checkpoints -> megafp8. The fixture's parameters come from Megatron-Core's own GPTModel
(local spec, RMSNorm, SwiGLU, GQA, RoPE, untied; built on CPU: its forward needs CUDA, so logits are not
compared here). TP=1: written as Megatron-LM does (``iter_N/mp_rank_00/model_optim_rng.pt`` with ``model``
and ``args``); the converted tensors equal Megatron-Core's under the documented name map. TP=2 x PP=2: the
same weights cut the way Megatron-Core shards them (whole query groups per rank, ``[gate_r; up_r]``, stage-local
layer indices) into ``mp_rank_XX_YYY`` files: this fixture is built here, not by Megatron's code; it must
convert to the bit-identical megafp8 checkpoint; so must the Transformer Engine spec's names."""
import argparse
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_testing import checkpoint_tensors, convert  # noqa: E402
from distributed_testing import run_distributed  # noqa: E402

ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            group_query_attention=True, seq_length=16, max_position_embeddings=32, norm_epsilon=1e-5,
            rotary_base=500000, untie_embeddings_and_output_weights=True, swiglu=True, normalization="RMSNorm",
            position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False, padded_vocab_size=128,
            vocab_size=100, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _save(root: Path, tp: int, pp: int, model: dict, staged: bool = False, **changes) -> None:
    """One rank's file as Megatron-LM writes it (``mp_rank_XX`` at PP=1, ``mp_rank_XX_YYY`` with stages)."""
    rank_dir = root / "iter_0000010" / (f"mp_rank_{tp:02d}_{pp:03d}" if staged else f"mp_rank_{tp:02d}")
    rank_dir.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**{**ARGS, **changes})
    torch.save({"model": model, "args": args, "iteration": 10, "checkpoint_version": 3.0},
               rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")


def _megatron_core_body(rank: int, world_size: int, root: str) -> None:
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                               num_query_groups=2, normalization="RMSNorm", layernorm_epsilon=1e-5,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32,
                     position_embedding_type="rope", rotary_base=500000, share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    _save(Path(root) / "tp1", 0, 0, model.state_dict())


def _shard_tp2_pp2(state: dict, root: Path) -> None:
    """Megatron-Core's TP=2 x PP=2 cut of a TP=1 state dict."""
    for tp in range(2):
        for pp in range(2):
            part = {}
            for name, value in state.items():
                if name.endswith("_extra_state"):
                    part[name] = value
                    continue
                if name.startswith("decoder.layers."):
                    layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
                    if int(layer) != pp:
                        continue
                    name = f"decoder.layers.0.{rest}"
                elif name.startswith("embedding.") and pp != 0 or not name.startswith("embedding.") and \
                        not name.startswith("decoder.layers.") and pp != 1:
                    continue
                if name.endswith(("linear_qkv.weight", "word_embeddings.weight")) or name == "output_layer.weight":
                    value = value.chunk(2)[tp]
                elif name.endswith("linear_fc1.weight"):
                    gate, up = value.chunk(2)
                    value = torch.cat([gate.chunk(2)[tp], up.chunk(2)[tp]])
                elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    value = value.chunk(2, dim=1)[tp]
                part[name] = value.clone()
            _save(root, tp, pp, part, staged=True, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


def test_megatron_checkpoints_convert(tmp_path):
    run_distributed(_megatron_core_body, world_size=1, args=(str(tmp_path),), timeout_s=300)
    rank_file = tmp_path / "tp1" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=False)["model"]
    result = convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "tp1",
                     "--save-dir", tmp_path / "m8")
    assert result.returncode == 0, result.stderr
    ours = checkpoint_tensors(tmp_path / "m8")
    expected = {"model.embedding.weight": state["embedding.word_embeddings.weight"][:100],
                "model.output_layer.weight": state["output_layer.weight"][:100],
                "model.final_layernorm.weight": state["decoder.final_layernorm.weight"]}
    for name, value in state.items():
        if name.startswith("decoder.layers.") and not name.endswith("_extra_state"):
            expected["model." + name.removeprefix("decoder.")] = value
    assert sorted(ours) == sorted(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in ours)

    _shard_tp2_pp2(state, tmp_path / "tp2pp2")
    assert convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "tp2pp2",
                   "--save-dir", tmp_path / "m8_tp2pp2").returncode == 0
    sharded = checkpoint_tensors(tmp_path / "m8_tp2pp2")
    assert sorted(sharded) == sorted(ours) and all(torch.equal(sharded[k], ours[k]) for k in ours)

    # Transformer Engine spec names: the norms fused into linear_qkv / linear_fc1, plus TE's _extra_state
    renames = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    te_state = {}
    for name, value in state.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        te_state[name] = value
    _save(tmp_path / "te", 0, 0, te_state)
    assert convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "te",
                   "--save-dir", tmp_path / "m8_te").returncode == 0
    te = checkpoint_tensors(tmp_path / "m8_te")
    assert sorted(te) == sorted(ours) and all(torch.equal(te[k], ours[k]) for k in ours)

    # a model megafp8 does not have, and a missing rank file: clear errors, nothing written
    _save(tmp_path / "bias", 0, 0, state, add_bias_linear=True)
    result = convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "bias",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and "--add-bias-linear True" in result.stderr
    (tmp_path / "tp2pp2" / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    result = convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "tp2pp2",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and "mp_rank_01_001" in result.stderr
    assert not (tmp_path / "out").exists()
