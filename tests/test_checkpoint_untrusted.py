"""A megafp8 checkpoint from someone else is data, never a program. Planted as an attacker would (a pickle whose
``__reduce__`` runs ``touch MARKER``, with the manifest's sizes and SHA-256 updated to match): in ``.metadata``
(the whole file, or one field of an otherwise valid index), in an RNG byte item (DCP's outer pickle, or the state
megafp8 pickles inside it), in the FP8 guard's item, ``extra``, an optimizer python value and a tensor chunk. Through
``python -m megafp8.pretrain --load`` / ``--finetune``, ``tools/convert_checkpoint.py --load-format megafp8`` (hf,
hf-fp8, megatron) and ``load_checkpoint`` the marker is never created, and a file that is read gives one error
line naming it; items a path never reads (RNG under ``--finetune`` or conversion) leave it working. Each plant is
first shown to fire under plain pickle, so the test cannot pass vacuously. Saving what would not load back
fails the save."""
import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from convert_testing import convert
from data_fixtures import REPO_ROOT, write_synthetic_dataset
from test_fp8_export_config import save_tiny_checkpoint

from megafp8.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megafp8.checkpoint.manifest import digest_file
from megafp8.checkpoint.safe_dcp import load_plain
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS

VOCAB = 100
MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--max-position-embeddings", "32", "--micro-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "90,10,0", "--eval-iters", "0",
         "--log-interval", "1"]
RNG_ITEM = "rng.rank00000"


class Payload:
    """Unpickled by a loader that trusts the file, it creates ``marker`` (harmless, and visible afterwards)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _update_manifest(directory: Path, *names: str) -> None:
    """What makes a tampered file pass the damage checks: its new size and SHA-256 in the manifest."""
    path = directory / "megafp8_checkpoint.json"
    manifest = json.loads(path.read_text())
    for name in names:
        manifest["files"][name] = digest_file(directory / name)
    path.write_text(json.dumps(manifest))


def _plain_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, untampered file


def plant_metadata(directory: Path, marker: Path, embedded: bool) -> None:
    """``.metadata`` replaced by the payload itself, or a valid index carrying it in one field."""
    if embedded:
        metadata = _plain_metadata(directory)
        metadata.planner_data = {"note": Payload(marker)}
        data = pickle.dumps(metadata)
    else:
        data = pickle.dumps(Payload(marker))
    (directory / ".metadata").write_bytes(data)
    _update_manifest(directory, ".metadata")


def plant_item(directory: Path, key: str, marker: Path, inner: bool) -> None:
    """The byte item ``key`` replaced: DCP's own pickle of it is the payload, or (``inner``) it wraps megafp8's
    pickled state dict whose value is the payload. The new bytes are appended to the item's file, the index
    points at them."""
    blob = _torch_bytes(_torch_bytes({"python": Payload(marker)}) if inner else Payload(marker))
    metadata = _plain_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == key)  # a tensor's first chunk, or the byte item
    info = metadata.storage_data[index]
    file = directory / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dcp_filesystem._StorageInfo(info.relative_path, offset, len(blob))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    _update_manifest(directory, ".metadata", info.relative_path)


def assert_fires_under_plain_pickle(directory: Path, marker: Path, key: str | None) -> None:
    """The plant is live: a loader that trusts the file (DCP's reader, torch.load(weights_only=False)) runs it."""
    metadata = _plain_metadata(directory)
    if key is not None:
        info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
        if isinstance(value, bytes):
            torch.load(io.BytesIO(value), weights_only=False)
    assert marker.exists(), "the planted payload does not fire: the test would pass vacuously"
    marker.unlink()


def plant(directory: Path, where: str, marker: Path) -> str:
    """Plant the payload at ``where``; returns the file a refusal must name."""
    if where.startswith("metadata"):
        plant_metadata(directory, marker, embedded=where == "metadata-field")
        assert_fires_under_plain_pickle(directory, marker, None)
        return str(directory / ".metadata")
    key = {"rng": RNG_ITEM, "guard": "fp8_guard.rank00000", "extra": "extra", "optimizer": "optimizer.step",
           "tensor": "model.embedding.weight"}[where.split("-")[0]]
    plant_item(directory, key, marker, inner=where.endswith("-state"))
    assert_fires_under_plain_pickle(directory, marker, key)
    if where == "tensor":  # DCP reads tensor chunks as a whole file's batch: the file is named
        return f"{directory / '__0_0.distcp'} is corrupt or not what megafp8 writes"
    return f"{directory / '__0_0.distcp'} (entry {key!r})"


def assert_one_error_line(stderr: str, names: str) -> None:
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and names in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def _pretrain(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megafp8.pretrain", *MODEL, *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """(a checkpoint directory `megafp8.pretrain` wrote at iteration 2, its --data-path)."""
    root = tmp_path_factory.mktemp("trained")
    prefix = str(root / "synthetic")
    lengths = torch.randint(20, 80, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    write_synthetic_dataset(prefix, lengths, vocab_size=VOCAB)
    result = _pretrain("--data-path", prefix, "--train-iters", "2", "--save", str(root / "run"),
                       "--save-interval", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run", prefix


def _copy(trained_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "published"
    shutil.copytree(trained_dir, root)
    return root, root / "iter_0000002"


@pytest.mark.parametrize("where, mode", [("metadata", "--load"), ("metadata", "--finetune"),
                                         ("metadata-field", "--load"), ("rng", "--load"),
                                         ("rng-state", "--load"), ("rng-state", "--finetune")])
def test_planted_payload_never_runs_through_pretrain(trained, tmp_path, where, mode):
    run_dir, prefix = trained
    root, directory = _copy(run_dir, tmp_path)
    marker = tmp_path / "PWNED"
    named = plant(directory, where, marker)
    flags = ["--finetune", "--train-iters", "1"] if mode == "--finetune" else ["--train-iters", "3"]
    result = _pretrain("--data-path", prefix, "--load", str(root), *flags)
    assert not marker.exists(), "code from the checkpoint ran"
    if where.startswith("rng") and mode == "--finetune":  # --finetune never reads RNG states: it just works
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    assert_one_error_line(result.stderr, named)


@pytest.mark.parametrize("where, save_format", [("metadata", "hf"), ("metadata", "hf-fp8"), ("metadata", "megatron"),
                                                ("tensor", "hf"), ("rng-state", "hf")])
def test_planted_payload_never_runs_through_the_converter(trained, tmp_path, where, save_format):
    root, directory = _copy(trained[0], tmp_path)
    marker = tmp_path / "PWNED"
    named = plant(directory, where, marker)
    result = convert("--load-format", "megafp8", "--save-format", save_format, "--load-dir", root,
                     "--save-dir", tmp_path / "out")
    assert not marker.exists(), "code from the checkpoint ran"
    if where.startswith("rng"):  # conversion never reads RNG states
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode == 1 and not (tmp_path / "out").exists(), result.stderr[-3000:]
    assert_one_error_line(result.stderr, named)


@pytest.mark.parametrize("where", ["guard", "guard-state"])
def test_planted_guard_state_never_runs_through_the_fp8_export(tmp_path, where):
    """hf-fp8 reads the saturation guard's item (which layers stay bf16)."""
    guard = SimpleNamespace(state_dict=lambda: {"strikes": {}, "switched": ["layers.1.mlp.linear_fc1"]})
    recipe = {"fp8_format": "hybrid", "fp8_recipe": "blockwise", "fp8_saturation_guard": True, "bf16": True}
    save_tiny_checkpoint(tmp_path / "m8", recipe, 3, num_layers=2, hidden_size=128, ffn_hidden_size=128,
                         saturation_guard=guard)
    marker = tmp_path / "PWNED"
    named = plant(tmp_path / "m8" / "iter_0000003", where, marker)
    result = convert("--load-format", "megafp8", "--save-format", "hf-fp8", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "out")
    assert not marker.exists(), "code from the checkpoint ran"
    assert result.returncode == 1, result.stderr[-3000:]
    assert_one_error_line(result.stderr, named)


def _tiny(ps: ParallelState) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                num_query_groups=2, seq_length=8, vocab_size=50, make_vocab_size_divisible_by=8), ps)


@pytest.mark.parametrize("where", ["extra-state", "optimizer", "tensor"])
def test_planted_payload_in_load_checkpoint_is_one_error(tmp_path, where):
    """``extra`` (megafp8's pickle inside DCP's), an optimizer python value (DCP's own pickle only), a tensor chunk."""
    ps = ParallelState().init_process_groups()
    path = save_checkpoint(tmp_path, 5, model=_tiny(ps), parallel_state=ps, extra={"progress": {"iteration": 5}},
                           optimizer_state={"step": 5})
    marker = tmp_path / "PWNED"
    named = plant(path, where, marker)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path, model=_tiny(ps), parallel_state=ps, optimizer_state={"step": 0})
    assert not marker.exists(), "code from the checkpoint ran"
    assert named in str(error.value) and "\n" not in str(error.value), str(error.value)


class _Custom:
    """Not plain data: a checkpoint could only load it by importing and running this module's code."""


def test_saving_what_would_not_load_back_fails_the_save(tmp_path):
    ps = ParallelState().init_process_groups()
    with pytest.raises(CheckpointError, match="extra would not load back"):
        save_checkpoint(tmp_path, 1, model=_tiny(ps), parallel_state=ps, extra={"schedule": _Custom()})
    with pytest.raises(CheckpointError, match="'optimizer.step' would not load back"):
        save_checkpoint(tmp_path, 1, model=_tiny(ps), parallel_state=ps, optimizer_state={"step": _Custom()})
    assert not list(tmp_path.glob("iter_0000001"))
    # plain values, tensors and numpy arrays (what RNG states hold) round-trip
    extra = {"counts": [1, 2.5, "x", None, (True,)], "state": np.random.get_state(), "t": torch.arange(3)}
    save_checkpoint(tmp_path, 2, model=_tiny(ps), parallel_state=ps, extra=extra)
    loaded = load_checkpoint(tmp_path, model=_tiny(ps), parallel_state=ps)
    assert loaded.extra["counts"] == extra["counts"] and torch.equal(loaded.extra["t"], extra["t"])
    saved_state, loaded_state = extra["state"], loaded.extra["state"]
    assert np.array_equal(loaded_state[1], saved_state[1]) and loaded_state[2:] == saved_state[2:]


def test_numpy_state_pickled_under_numpy_1_loads():
    """numpy 1 pickles its arrays as ``numpy.core.multiarray._reconstruct``, numpy 2 as ``numpy._core...``: an RNG
    state saved under either loads (the names are allowed, the functions are the same)."""
    state = np.random.get_state()
    written = zipfile.ZipFile(io.BytesIO(_torch_bytes({"numpy": state, "scalar": np.float64(1.5)})))
    renamed = io.BytesIO()
    with zipfile.ZipFile(renamed, "w") as archive:
        for entry in written.infolist():  # torch.save's protocol 2 spells globals as text lines: renaming is safe
            data = written.read(entry)
            if entry.filename.endswith("data.pkl"):
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
                assert b"numpy.core.multiarray" in data and b"numpy._core" not in data
            archive.writestr(entry, data)
    loaded = load_plain(renamed.getvalue(), "a numpy 1 RNG state")
    assert np.array_equal(loaded["numpy"][1], state[1]) and loaded["numpy"][2:] == state[2:]
    assert loaded["scalar"] == 1.5
