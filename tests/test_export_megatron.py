"""megafp8 -> Megatron-LM legacy checkpoints (``--save-format megatron``): Megatron-Core 0.16's own GPTModel (local
spec, built on CPU as in test_convert_megatron.py; its forward needs CUDA) loads each rank file strictly, at TP=1,
TP=2 and PP=2 (tied embeddings at TP=2 too), after ``torch.load`` as Megatron-LM's loader calls it; its parameters
equal the source Hugging Face model's weights cut by Megatron-Core's documented layout (built here from the HF
tensors, not by megafp8). The files unpickle with only ``argparse.Namespace`` allowed (no megafp8 class inside),
and megafp8 -> megatron -> megafp8 (the legacy reader) is bit-identical in fp32."""
import argparse
from pathlib import Path

import pytest
import torch

from convert_testing import checkpoint_tensors, convert, tiny_hf_llama
from distributed_testing import run_distributed

from megafp8.checkpoint.convert_hf import hf_to_megafp8
from megafp8.checkpoint.convert_megatron import megatron_to_megafp8
from megafp8.checkpoint.export_megatron import megafp8_to_megatron
from megafp8.checkpoint.hf_files import ConversionError

# (tied, TP, PP) layouts the Megatron-Core model loads; a tied model is not built with stages (Megatron-Core's
# tied-embedding setup over a pipeline moves the weight to CUDA)
LAYOUTS = ((False, 1, 1), (False, 2, 1), (False, 1, 2), (True, 2, 1))


def _export_dir(root: Path, tied: bool, tp: int, pp: int) -> Path:
    return root / f"mt_{'tied' if tied else 'untied'}_tp{tp}_pp{pp}"


def _megatron_core_body(rank: int, world_size: int, root: str) -> None:
    import megatron.core  # noqa: F401 - registers Megatron-Core's safe globals, as Megatron-LM's loader has them
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    for tied, tp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, pp)
        t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        export = _export_dir(Path(root), tied, tp, pp)
        step = int((export / "latest_checkpointed_iteration.txt").read_text())
        state = torch.load(export / f"iter_{step:07d}" / rank_dir / "model_optim_rng.pt", map_location="cpu")
        args = state["args"]
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == step == args.iteration
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
        config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                                   num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                                   normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
                                   gated_linear_unit=args.swiglu, activation_func=F.silu,
                                   add_bias_linear=args.add_bias_linear, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, use_cpu_initialization=True,
                                   params_dtype=torch.float32, pipeline_dtype=torch.float32)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage(),
                         position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
        model.load_state_dict(state["model"], strict=True)
        if parallel_state.get_data_parallel_rank() == 0:
            torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                       export / f"loaded_{rank_dir}.pt")
        parallel_state.destroy_model_parallel()


def _megatron_rank_tensors(hf: dict[str, torch.Tensor], *, heads: int, groups: int, tied: bool, tp: int, pp: int,
                           t: int, p: int, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Rank (t, p)'s Megatron-Core local-spec tensors, cut from HF Llama weights by Megatron-Core's layout."""
    def padded(weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([weight, weight.new_zeros(padded_vocab - weight.shape[0], weight.shape[1])]).chunk(tp)[t]

    layers = 1 + max(int(name.split(".")[2]) for name in hf if name.startswith("model.layers."))
    per_stage = layers // pp
    out = {}
    if p == 0:
        out["embedding.word_embeddings.weight"] = padded(hf["model.embed_tokens.weight"])
    for local in range(per_stage):
        src, dst = f"model.layers.{p * per_stage + local}.", f"decoder.layers.{local}."
        q, k, v = (hf[src + f"self_attn.{x}_proj.weight"] for x in "qkv")
        d = k.shape[0] // groups
        per_group = [torch.cat([q.view(heads, d, -1)[g * heads // groups:(g + 1) * heads // groups].flatten(0, 1),
                                k.view(groups, d, -1)[g], v.view(groups, d, -1)[g]]) for g in range(groups)]
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat(per_group[t * groups // tp:(t + 1) * groups // tp])
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"].chunk(tp)[t],
                                                        hf[src + "mlp.up_proj.weight"].chunk(tp)[t]])
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"].chunk(tp, dim=1)[t]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
    if p == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not tied:
            out["output_layer.weight"] = padded(hf["lm_head.weight"])
    return out


def test_megatron_core_loads_the_export_strictly_and_it_round_trips(tmp_path):
    pytest.importorskip("megatron.core")
    sources = {}
    for tied in (False, True):
        hf = tiny_hf_llama(tmp_path / f"hf_{tied}", tie=tied, vocab_size=100)
        sources[tied] = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        hf_to_megafp8(tmp_path / f"hf_{tied}", tmp_path / f"m8_{tied}", progress=False)
    result = convert("--load-format", "megafp8", "--save-format", "megatron", "--load-dir", tmp_path / "m8_False",
                     "--save-dir", _export_dir(tmp_path, False, 2, 2), "--target-tensor-parallel-size", 2,
                     "--target-pipeline-parallel-size", 2)
    assert result.returncode == 0, result.stderr
    assert "--finetune --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in result.stdout
    for tied, tp, pp in LAYOUTS:  # the same code as the tool, in this process (one import, not one each)
        megafp8_to_megatron(tmp_path / f"m8_{tied}", _export_dir(tmp_path, tied, tp, pp), target_tp=tp,
                            target_pp=pp, progress=False)

    run_distributed(_megatron_core_body, world_size=2, args=(str(tmp_path),), timeout_s=300)
    for tied, tp, pp in LAYOUTS:
        export = _export_dir(tmp_path, tied, tp, pp)
        for t in range(tp):
            for p in range(pp):
                rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                loaded = torch.load(export / f"loaded_{rank_dir}.pt", weights_only=True)
                expected = _megatron_rank_tensors(sources[tied], heads=4, groups=2, tied=tied, tp=tp, pp=pp, t=t,
                                                  p=p, padded_vocab=128 * tp)
                assert sorted(loaded) == sorted(expected), (tied, tp, pp, rank_dir)
                for name, value in expected.items():
                    assert torch.equal(loaded[name], value), (tied, tp, pp, rank_dir, name)

    # no megafp8 or Megatron class in the pickle: argparse.Namespace is the only non-tensor global
    rank_file = _export_dir(tmp_path, False, 2, 2) / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(rank_file, weights_only=True)
    assert sorted(state) == ["args", "checkpoint_version", "iteration", "model", "num_floating_point_operations_so_far"]
    args = state["args"]
    assert (args.padded_vocab_size, args.vocab_size, args.make_vocab_size_divisible_by) == (256, 100, 128)
    assert (args.num_query_groups, args.group_query_attention, args.kv_channels, args.rotary_base) == (2, True, 16,
                                                                                                      500000)
    assert (args.normalization, args.swiglu, args.position_embedding_type, args.add_bias_linear) == (
        "RMSNorm", True, "rope", False)

    # megafp8 -> megatron -> megafp8 with the legacy reader: bit-identical (fp32)
    for tied, tp, pp in ((False, 2, 2), (False, 1, 2), (True, 2, 1)):
        back = tmp_path / f"back_{tied}_{tp}_{pp}"
        megatron_to_megafp8(_export_dir(tmp_path, tied, tp, pp), back, progress=False)
        ours, original = checkpoint_tensors(back), checkpoint_tensors(tmp_path / f"m8_{tied}")
        assert sorted(ours) == sorted(original), (tied, tp, pp)
        assert all(torch.equal(ours[k], original[k]) for k in ours), (tied, tp, pp)


def test_megatron_export_errors_name_the_flag(tmp_path):
    tiny_hf_llama(tmp_path / "hf", tie=False, num_layers=2)
    hf_to_megafp8(tmp_path / "hf", tmp_path / "m8", progress=False)
    result = convert("--load-format", "megafp8", "--save-format", "megatron", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "out", "--target-tensor-parallel-size", "3")
    assert result.returncode == 1 and "--target-tensor-parallel-size 3 does not divide" in result.stderr, result.stderr
    for options, message in (({"target_pp": 3}, "--target-pipeline-parallel-size 3 does not divide"),
                             ({"make_vocab_size_divisible_by": 0}, "--make-vocab-size-divisible-by must be")):
        with pytest.raises(ConversionError, match=message):
            megafp8_to_megatron(tmp_path / "m8", tmp_path / "out", progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_llama3_rope_scaling_travels_to_megatron_and_back(tmp_path):
    """Megatron-LM's --use-rope-scaling / --rope-scaling-factor are written, and read back into the same RoPE."""
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    tiny_hf_llama(tmp_path / "hf", tie=True, num_layers=2, max_position_embeddings=16384, rope_scaling=rope)
    source = hf_to_megafp8(tmp_path / "hf", tmp_path / "m8", progress=False)
    megafp8_to_megatron(tmp_path / "m8", tmp_path / "mg", progress=False)
    back = megatron_to_megafp8(tmp_path / "mg", tmp_path / "back", progress=False)
    assert back.use_rope_scaling and back.rope_scaling == source.rope_scaling
    assert (back.rope_scaling.factor, back.rope_scaling.original_max_position_embeddings) == (32.0, 8192)
