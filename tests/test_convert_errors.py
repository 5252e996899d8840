"""Conversion inputs megafp8 cannot convert fail with one clear message naming the tensor, field, flag or
file (a --load-dir that is missing or not a checkpoint, in every --load-format, too), and leave nothing under
the target name (nor a temporary beside it)."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from convert_testing import convert, tiny_hf_llama  # noqa: E402
from data_fixtures import REPO_ROOT  # noqa: E402
from megatron_testing import save_rank_file, synthetic_megatron_state  # noqa: E402

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


def _negative_offsets(hf: Path) -> None:
    """The first tensor's bytes moved to [-256, 0): the header's own bytes (issue 38's repro)."""
    import struct

    raw = (hf / SHARD).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"] = [-256, 0]
    text = json.dumps(header).encode()
    (hf / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


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
    "incomplete llama3 rope_scaling": (
        lambda hf: _edit_config(hf, rope_scaling={"rope_type": "llama3", "factor": 8.0}), [],
        "rope_scaling with rope_type 'llama3' lacks low_freq_factor, high_freq_factor"),
    "bias": (lambda hf: _edit_config(hf, attention_bias=True), [], "attention_bias=True"),
    "non-divisible target TP": (lambda hf: None, ["--target-tensor-parallel-size", "3"],
                                "--target-tensor-parallel-size 3 does not divide num_attention_heads (4)"),
    "non-divisible target PP": (lambda hf: None, ["--target-pipeline-parallel-size", "3"],
                                "--target-pipeline-parallel-size 3 does not divide num_hidden_layers (2)"),
    "truncated safetensors": (_truncate, [], SHARD),
    "negative data_offsets": (_negative_offsets, [], f"{SHARD} is truncated or not a safetensors file"),
    # Issue 38: sizes from a header are cross-checked before anything is allocated; nonsense values are one line
    "a billion layers": (lambda hf: _edit_config(hf, num_hidden_layers=10**9), [],
                         "num_hidden_layers 1000000000, but its safetensors files hold 2 layers"),
    "rope_theta 0": (lambda hf: _edit_config(hf, rope_theta=0), [], "rope_theta 0 must be a positive number"),
    "rms_norm_eps -1": (lambda hf: _edit_config(hf, rms_norm_eps=-1), [], "rms_norm_eps -1 must be a positive number"),
    "max_position_embeddings 0": (lambda hf: _edit_config(hf, max_position_embeddings=0), [],
                                  "max_position_embeddings 0 must be a positive integer"),
    "num_attention_heads 0": (lambda hf: _edit_config(hf, num_attention_heads=0), [],
                              "num_attention_heads 0 must be a positive integer"),
    "hidden_size a string": (lambda hf: _edit_config(hf, hidden_size="64"), [],
                             "hidden_size '64' must be a positive integer"),
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
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", pristine,
                   "--save-dir", tmp_path / "m8").returncode == 0
    manifest_path = tmp_path / "m8" / "iter_0000000" / "megafp8_checkpoint.json"
    manifest = manifest_path.read_text()
    huge = json.loads(manifest)
    huge["args"]["num_layers"] = 10**9  # sized from before anything is allocated: one line, not gigabytes
    manifest_path.write_text(json.dumps(huge))
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and "num_layers 1000000000, but the checkpoint holds 2 layers" in result.stderr
    manifest_path.write_text(manifest)
    data = next((tmp_path / "m8" / "iter_0000000").glob("*.distcp"))
    os.truncate(data, data.stat().st_size - 10)
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "out")
    assert result.returncode == 1 and f"{data} is truncated" in result.stderr, result.stderr
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", pristine,
                     "--save-dir", tmp_path / "m8")
    assert result.returncode == 1 and "already exists and is not empty" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m8"]


def _convert_in_process(capsys, *args) -> tuple[int, str]:
    """tools/convert_checkpoint.py's main() here (cheaper than a subprocess for checks that fail early)."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint",
                                                  os.path.join(REPO_ROOT, "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    code = tool.main(["--no-progress", *map(str, args)])
    return code, capsys.readouterr().err


FORMATS = {"hf": ("megafp8", "has no config.json"), "megafp8": ("hf", "has no latest_checkpointed_iteration.txt"),
           "megatron": ("megafp8", "has no latest_checkpointed_iteration.txt")}


@pytest.mark.parametrize("load_format", list(FORMATS))
def test_load_dir_that_is_not_a_checkpoint_names_the_flag_and_path(load_format, tmp_path, capsys):
    save_format, empty_message = FORMATS[load_format]
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    for name, message in (("nope", "does not exist"), ("a_file", "is not a directory"), ("empty", empty_message)):
        code, err = _convert_in_process(capsys, "--load-format", load_format, "--save-format", save_format,
                                        "--load-dir", tmp_path / name, "--save-dir", tmp_path / "out")
        assert code == 1 and f"error: --load-dir {tmp_path / name} {message}" in err, err
    if load_format != "hf":
        code, err = _convert_in_process(capsys, "--load-format", load_format, "--save-format", save_format,
                                        "--load-dir", tmp_path / "empty", "--load-iteration", "5",
                                        "--save-dir", tmp_path / "out")
        assert code == 1 and f"--load-iteration 5: --load-dir {tmp_path / 'empty'} has no iter_0000005" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "empty"]


def test_megatron_input_errors(tmp_path, capsys):
    """Rank files Megatron did not finish writing, args without the model's shape, a tracker naming a missing
    iteration, a torch_dist checkpoint with an empty .metadata: one line naming the file or field."""
    def run(root: Path) -> str:
        code, err = _convert_in_process(capsys, "--load-format", "megatron", "--save-format", "megafp8",
                                        "--load-dir", root, "--save-dir", tmp_path / "out")
        assert code == 1 and "Traceback" not in err
        return err

    state = synthetic_megatron_state()
    rank_file = save_rank_file(tmp_path / "truncated", 0, 0, state)
    os.truncate(rank_file, rank_file.stat().st_size // 2)
    assert f"{rank_file} is truncated or not a PyTorch checkpoint" in run(tmp_path / "truncated")

    save_rank_file(tmp_path / "no_shape", 0, 0, state, num_layers=None, hidden_size="64")
    assert "the saved args lack num_layers, hidden_size" in run(tmp_path / "no_shape")

    save_rank_file(tmp_path / "ahead", 0, 0, state)
    (tmp_path / "ahead" / "latest_checkpointed_iteration.txt").write_text("20")
    assert f"names 20, but {tmp_path / 'ahead' / 'iter_0000020'} does not exist" in run(tmp_path / "ahead")

    distributed = tmp_path / "torch_dist" / "iter_0000010"
    distributed.mkdir(parents=True)
    (distributed / ".metadata").write_bytes(b"")
    (distributed / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("10")
    assert f"{distributed / '.metadata'} is corrupt or truncated" in run(tmp_path / "torch_dist")  # read as torch_dist
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["parent is a file", "symlink to an empty directory", "max-shard-size abc",
                                  "max-shard-size nanGB", "max-shard-size 0"])
def test_bad_save_dir_and_shard_size_are_one_line_before_any_work(case, pristine, tmp_path, capsys):
    """Issue 38 item 13: each was a traceback, the symlink one after a whole conversion."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    save, extra, message = {
        "parent is a file": (tmp_path / "a_file" / "out", [], f"--save-dir {tmp_path / 'a_file' / 'out'}: "
                             f"{tmp_path / 'a_file'} is not a directory"),
        "symlink to an empty directory": (tmp_path / "link", [], "is a symbolic link; give the directory itself"),
        "max-shard-size abc": (tmp_path / "out", ["--max-shard-size", "abc"], "--max-shard-size abc: expected"),
        "max-shard-size nanGB": (tmp_path / "out", ["--max-shard-size", "nanGB"], "--max-shard-size nanGB: expected"),
        "max-shard-size 0": (tmp_path / "out", ["--max-shard-size", "0"], "--max-shard-size 0: expected"),
    }[case]
    if case.startswith("symlink"):
        (tmp_path / "link").symlink_to(tmp_path / "empty")
    code, err = _convert_in_process(capsys, "--load-format", "hf", "--save-format", "megafp8", "--load-dir",
                                    pristine, "--save-dir", save, *extra)
    assert code == 1 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a_file", "empty"] + (["link"] if "symlink" in case else []))
    assert list((tmp_path / "empty").iterdir()) == []
