"""Megatron-LM legacy checkpoints -> megafp8, with or without Megatron installed.

The first fixture's parameters come from Megatron-Core's own GPTModel (local spec, RMSNorm, SwiGLU, GQA, RoPE,
untied; built on CPU; its logits, and its own TP=2 shards as rank files, are checked in
tests/test_convert_megatron_dist.py). TP=1: written as Megatron-LM does
(``iter_N/mp_rank_00/model_optim_rng.pt`` with ``model``, ``args`` holding Megatron enums, RNG and optimizer
state); the converted tensors equal Megatron-Core's under the documented name map. TP=2 x PP=2: the same weights
cut the way Megatron-Core shards them into ``mp_rank_XX_YYY`` files (built here, not by Megatron's code); it must
convert to the bit-identical megafp8 checkpoint; so must the Transformer Engine spec's names. Every rank file
also names a class the installed Megatron-Core lacks and one from a package that does not exist (as a file
from another Megatron version does); the converter reads them with every ``megatron`` import blocked too."""
import argparse
import io
import pickle
from pathlib import Path

import pytest
import torch

from convert_testing import checkpoint_tensors, convert  # noqa: E402
from distributed_testing import run_distributed  # noqa: E402
from megatron_testing import (DistributedOptimizerState, RunsCode, convert_without_megatron, expected_megafp8,
                              foreign_class, save_rank_file, shard_tp2_pp2, synthetic_megatron_state)

from megafp8.checkpoint import safe_unpickler
from megafp8.checkpoint.convert_megatron import megatron_to_megafp8
from megafp8.checkpoint.hf_files import ConversionError

def _megatron_core_body(rank: int, world_size: int, root: str) -> None:
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend
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
    torch.save(model.state_dict(), Path(root) / "reference.pt")  # plain tensors: the test's reference
    # Megatron-LM's args hold Megatron-Core's enums (attention_backend is one since 0.11)
    save_rank_file(Path(root) / "tp1", 0, 0, model.state_dict(), extra_args={"attention_backend": AttnBackend.auto})


def test_megatron_checkpoints_convert(tmp_path):
    pytest.importorskip("megatron.core")
    run_distributed(_megatron_core_body, world_size=1, args=(str(tmp_path),), timeout_s=300)
    state = torch.load(tmp_path / "reference.pt", weights_only=True)
    rank_file = tmp_path / "tp1" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(AttributeError, match="InferenceCudaGraphScope"):  # the issue: a plain load fails
        torch.load(rank_file, weights_only=False)
    result = convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "tp1",
                     "--save-dir", tmp_path / "m8")
    assert result.returncode == 0, result.stderr
    ours = checkpoint_tensors(tmp_path / "m8")
    expected = expected_megafp8(state)
    assert sorted(ours) == sorted(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in ours)
    result = convert_without_megatron("--load-format", "megatron", "--save-format", "megafp8", "--load-dir",
                                      tmp_path / "tp1", "--save-dir", tmp_path / "m8_no_megatron")
    assert result.returncode == 0, result.stderr
    no_megatron = checkpoint_tensors(tmp_path / "m8_no_megatron")
    assert sorted(no_megatron) == sorted(ours) and all(torch.equal(no_megatron[k], ours[k]) for k in ours)

    # the rest in-process: the command line was checked above (a subprocess costs ~10 s on the test machines)
    shard_tp2_pp2(state, tmp_path / "tp2pp2")
    megatron_to_megafp8(tmp_path / "tp2pp2", tmp_path / "m8_tp2pp2", progress=False)
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
    save_rank_file(tmp_path / "te", 0, 0, te_state)
    megatron_to_megafp8(tmp_path / "te", tmp_path / "m8_te", progress=False)
    te = checkpoint_tensors(tmp_path / "m8_te")
    assert sorted(te) == sorted(ours) and all(torch.equal(te[k], ours[k]) for k in ours)

    # a model megafp8 does not have, and a missing rank file: clear errors, nothing written
    save_rank_file(tmp_path / "bias", 0, 0, state, add_bias_linear=True)
    with pytest.raises(ConversionError, match="--add-bias-linear True"):
        megatron_to_megafp8(tmp_path / "bias", tmp_path / "out", progress=False)
    (tmp_path / "tp2pp2" / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(ConversionError, match="mp_rank_01_001"):
        megatron_to_megafp8(tmp_path / "tp2pp2", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


class ForeignNamespace(argparse.Namespace):
    """Megatron's ``args`` as a Namespace subclass of a module that does not exist here."""


def test_rank_files_naming_missing_classes_convert_without_megatron(tmp_path):
    """A TP=2 x PP=2 checkpoint whose args, optimizer and RNG state name classes nobody here can import (and
    whose args hold an object that runs a shell command when plain pickle loads it) converts to the documented
    name map of its weights, the same with every megatron import blocked, and runs no code from the file."""
    marker = tmp_path / "code_from_the_file_ran"
    state = synthetic_megatron_state()
    with foreign_class(ForeignNamespace, "nonexistent_pkg.arguments"):
        shard_tp2_pp2(state, tmp_path / "tp2pp2", args_class=ForeignNamespace,
                      extra_args={"post_load_hook": RunsCode(marker)})
    rank_file = tmp_path / "tp2pp2" / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    with pytest.raises(ModuleNotFoundError, match="nonexistent_pkg"):
        torch.load(rank_file, weights_only=False)
    expected = expected_megafp8(state)
    flags = ("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "tp2pp2")
    megatron_to_megafp8(tmp_path / "tp2pp2", tmp_path / "m8", progress=False)
    result = convert_without_megatron(*flags, "--save-dir", tmp_path / "m8_no_megatron")
    assert result.returncode == 0, result.stderr
    for out in ("m8", "m8_no_megatron"):
        ours = checkpoint_tensors(tmp_path / out)
        assert sorted(ours) == sorted(expected) and all(torch.equal(ours[k], expected[k]) for k in ours), out
    assert not marker.exists()


def test_safe_unpickler_keeps_tensors_and_records_the_rest(tmp_path):
    marker = tmp_path / "ran"
    weight = torch.randn(3, 4)
    with foreign_class(DistributedOptimizerState, "nonexistent_pkg.optimizer"):
        torch.save({"w": weight, "view": weight[1:, ::2], "opt": DistributedOptimizerState({"w": weight}),
                    "hook": RunsCode(marker), "p": torch.nn.Parameter(weight), "dtype": torch.bfloat16,
                    "bytes": b"\x00\xff", "set": {1, 2}},
                   tmp_path / "zip.pt")
        torch.save({"w": weight, "opt": DistributedOptimizerState({"w": weight})}, tmp_path / "legacy.pt",
                   _use_new_zipfile_serialization=False)
    loaded = safe_unpickler.load(tmp_path / "zip.pt")
    assert torch.equal(loaded["w"], weight) and torch.equal(loaded["view"], weight[1:, ::2])
    assert type(loaded["p"]) is torch.nn.Parameter and torch.equal(loaded["p"], weight)
    assert loaded["dtype"] is torch.bfloat16 and loaded["bytes"] == b"\x00\xff" and loaded["set"] == {1, 2}
    opt = loaded["opt"]
    assert isinstance(opt, safe_unpickler.Placeholder)
    assert opt.qualified_name == "nonexistent_pkg.optimizer.DistributedOptimizerState"
    assert torch.equal(opt.fields()["tensors"]["w"], weight) and opt.fields()["grad_scaler"] == {"scale": 4096.0}
    hook = loaded["hook"]
    assert hook.qualified_name in ("posix.system", "nt.system") and hook.args == (f"touch {marker}",)
    assert not marker.exists()
    legacy = safe_unpickler.load(tmp_path / "legacy.pt")
    assert torch.equal(legacy["w"], weight) and torch.equal(legacy["opt"].fields()["tensors"]["w"], weight)

    # BUILD on a class the file names would patch this process's code (argparse.Namespace.x = ...): refused
    patch_a_class = (pickle.PROTO + b"\x02" + pickle.GLOBAL + b"argparse\nNamespace\n" + pickle.NONE
                     + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x01x" + pickle.BININT1 + b"\x01"
                     + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    with pytest.raises(pickle.UnpicklingError, match="class or function"):
        safe_unpickler.Unpickler(io.BytesIO(patch_a_class)).load()
    assert not hasattr(argparse.Namespace, "x")
    assert pickle.loads(patch_a_class) is argparse.Namespace and argparse.Namespace.x == 1  # what plain pickle does
    del argparse.Namespace.x
