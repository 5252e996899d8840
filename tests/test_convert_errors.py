"""Conversion inputs megafp8 cannot convert fail with one clear message naming the tensor, field, flag or
file, and leave nothing under the target name (nor a temporary beside it)."""
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from convert_testing import convert, tiny_hf_llama  # noqa: E402

SHARD = "model-00002-of-00004.safetensors"  # holds some of layer 0


def _edit_config(hf: Path, **changes) -> None:
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))


def _drop_tensor(hf: Path, name: str) -> None:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    file = hf / index["weight_map"].pop(name)
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _reshape_tensor(hf: Path, name: str) -> None:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    file = hf / index["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def _truncate(hf: Path) -> None:
    path = hf / SHARD
    os.truncate(path, path.stat().st_size - 100)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "hf"
    tiny_hf_llama(directory, tie=False, num_layers=2, max_shard_size="80KB")
    assert (directory / SHARD).exists()
    return directory


CASES = {
    "missing tensor": (lambda hf: _drop_tensor(hf, "model.layers.1.mlp.up_proj.weight"), [],
                       "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    "shape mismatch": (lambda hf: _reshape_tensor(hf, "model.layers.0.self_attn.k_proj.weight"), [],
                       "'model.layers.0.self_attn.k_proj.weight' has shape [31, 64], config.json implies [32, 64]"),
    "unknown model_type": (lambda hf: _edit_config(hf, model_type="mistral"), [],
                           "model_type 'mistral' is not supported"),
    "llama-3.1 rope_scaling": (lambda hf: _edit_config(hf, rope_scaling={"rope_type": "llama3", "factor": 8.0}), [],
                               "rope_scaling"),
    "bias": (lambda hf: _edit_config(hf, attention_bias=True), [], "attention_bias=True"),
    "non-divisible target TP": (lambda hf: None, ["--target-tensor-parallel-size", "3"],
                                "--target-tensor-parallel-size 3 does not divide num_attention_heads (4)"),
    "non-divisible target PP": (lambda hf: None, ["--target-pipeline-parallel-size", "3"],
                                "--target-pipeline-parallel-size 3 does not divide num_hidden_layers (2)"),
    "truncated safetensors": (_truncate, [], SHARD),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_input_errors_name_the_cause_and_write_nothing(case, pristine, tmp_path):
    damage, flags, message = CASES[case]
    hf = tmp_path / "hf"
    hf.mkdir()
    for file in pristine.iterdir():
        (hf / file.name).write_bytes(file.read_bytes())
    damage(hf)
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", hf,
                     "--save-dir", tmp_path / "out", *flags)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no out/, no .out.tmp-*


def test_megafp8_input_errors(pristine, tmp_path):
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "nothing",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and "has no latest_checkpointed_iteration.txt" in result.stderr
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", pristine,
                   "--save-dir", tmp_path / "m8").returncode == 0
    data = next((tmp_path / "m8" / "iter_0000000").glob("*.distcp"))
    os.truncate(data, data.stat().st_size - 10)
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and f"{data} is truncated" in result.stderr, result.stderr
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", pristine,
                     "--save-dir", tmp_path / "m8")
    assert result.returncode == 1 and "already exists and is not empty" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m8"]
