"""Megatron-Core ``torch_dist`` checkpoints -> megafp8 -> HF, against Megatron-Core's own forward.

One module fixture runs Megatron-Core 0.16.1 on CPU at TP=2 (two gloo processes): its GPTModel's logits and
two torch_dist checkpoints written by its own ``dist_checkpointing.save`` (``tests/megatron_testing.py``:
0.16's layout with ``common.pt`` and layers stacked over layers; Megatron-LM's current layout with the common
state inside the DCP files, one key per layer and ``linear_fc1`` in halves). Converted, exported to HF and run
in transformers they give Megatron's logits; the second converts to the same bytes with every ``megatron``
import blocked, and so do a TP=1 x PP=2 save of the same weights and the model's own TP=2 state dicts written
as legacy rank files. Damaged copies fail with one ConversionError naming the file or key, writing nothing."""
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from convert_testing import TOLERANCE, checkpoint_tensors, rel_err
from distributed_testing import run_distributed
from megatron_testing import (DIST_TOKENS, DIST_VOCAB, RunsCode, convert_without_megatron,
                              save_megatron_dist_checkpoints)

from megafp8.checkpoint.convert_hf import megafp8_to_hf
from megafp8.checkpoint.convert_megatron import megatron_to_megafp8
from megafp8.checkpoint.hf_files import ConversionError

ITER = "iter_0000010"


@pytest.fixture(scope="module")
def megatron_dist(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron_dist")
    run_distributed(save_megatron_dist_checkpoints, world_size=2, args=(str(root),), timeout_s=400)
    megatron_to_megafp8(root / "mcore", root / "mcore_m8", progress=False)
    return root


def test_torch_dist_checkpoint_gives_megatron_logits_in_transformers(megatron_dist, tmp_path):
    import transformers

    common = megatron_dist / "mcore" / ITER / "common.pt"
    with pytest.raises(AttributeError, match="InferenceCudaGraphScope"):  # a class Megatron-Core 0.16 lacks
        torch.load(common, weights_only=False)
    megafp8_to_hf(megatron_dist / "mcore_m8", tmp_path / "hf", save_dtype="fp32", progress=False)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert model.config.vocab_size == DIST_VOCAB
    with torch.no_grad():
        logits = model(DIST_TOKENS).logits
    expected = torch.load(megatron_dist / "logits.pt")  # Megatron-Core's forward at TP=2, padded vocab cut
    assert rel_err(logits, expected) < TOLERANCE


def test_megatron_lm_layout_converts_the_same_without_megatron(megatron_dist, tmp_path):
    assert not (megatron_dist / "lm" / ITER / "common.pt").exists()
    result = convert_without_megatron("--load-format", "megatron", "--save-format", "megafp8", "--load-dir",
                                      megatron_dist / "lm", "--save-dir", tmp_path / "m8")
    assert result.returncode == 0, result.stderr
    ours, reference = checkpoint_tensors(tmp_path / "m8"), checkpoint_tensors(megatron_dist / "mcore_m8")
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[k], reference[k]) for k in ours)


@pytest.mark.parametrize("layout", ["pp2", "legacy"])
def test_other_layouts_of_the_model_convert_the_same(megatron_dist, tmp_path, layout):
    """The TP=1 x PP=2 torch_dist save (after Megatron-Core's own resharding load), and Megatron-Core's own TP=2
    shards (per-rank ``[gate_r; up_r]``) as legacy rank files: the same weights."""
    megatron_to_megafp8(megatron_dist / layout, tmp_path / "m8", progress=False)
    ours, reference = checkpoint_tensors(tmp_path / "m8"), checkpoint_tensors(megatron_dist / "mcore_m8")
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[k], reference[k]) for k in ours)


def _copy(megatron_dist: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(megatron_dist / "mcore", root)
    return root / ITER


def _rewrite_metadata(iteration_dir: Path, change) -> None:
    metadata = dcp.FileSystemReader(iteration_dir).read_metadata()  # plain pickle: the test's own file
    change(metadata)
    with open(iteration_dir / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def _add_bias(metadata) -> None:
    metadata.state_dict_metadata["decoder.layers.mlp.linear_fc1.bias"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([2, 192]), [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                                          torch.Size([2, 192]))])


def _grow_fc2(metadata) -> None:
    metadata.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"].size = torch.Size([2, 64, 80])


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / ".metadata").unlink(), r"has \*\.distcp files but no \.metadata"),
    (lambda d: (d / ".metadata").write_bytes(b"\x80\x04not a pickle"), r"\.metadata is corrupt or truncated"),
    (lambda d: (d / "__1_0.distcp").write_bytes((d / "__1_0.distcp").read_bytes()[:1000]),
     r"__1_0\.distcp is truncated: entry '"),
    (lambda d: (d / "common.pt").unlink(), r"has neither common\.pt nor a 'common_state' entry"),
    (lambda d: (d / "common.pt").write_bytes((d / "common.pt").read_bytes()[:300]),
     r"common\.pt is truncated or not a PyTorch checkpoint"),
    (lambda d: _rewrite_metadata(d, _add_bias),
     r"entries megafp8's Llama does not have: \['decoder\.layers\.mlp\.linear_fc1\.bias'\]"),
    (lambda d: _rewrite_metadata(d, _grow_fc2),
     r"'decoder\.layers\.mlp\.linear_fc2\.weight' has shape \[2, 64, 80\], the checkpoint's flags imply \[2, 64, 96\]"),
], ids=["no-metadata", "corrupt-metadata", "truncated-distcp", "no-common-state", "truncated-common",
        "unknown-key", "shape-mismatch"])
def test_damaged_torch_dist_checkpoints_name_the_cause(megatron_dist, tmp_path, damage, message):
    iteration_dir = _copy(megatron_dist, tmp_path)
    damage(iteration_dir)
    with pytest.raises(ConversionError, match=message):
        megatron_to_megafp8(iteration_dir.parent, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_metadata_pickle_runs_no_code(megatron_dist, tmp_path):
    """``.metadata`` is a pickle too: an object in it that runs a shell command under plain pickle stays inert."""
    marker = tmp_path / "code_from_the_file_ran"
    iteration_dir = _copy(megatron_dist, tmp_path)
    _rewrite_metadata(iteration_dir, lambda metadata: setattr(metadata, "post_load_hook", RunsCode(marker)))
    megatron_to_megafp8(iteration_dir.parent, tmp_path / "out", progress=False)
    assert not marker.exists()
    ours, reference = checkpoint_tensors(tmp_path / "out"), checkpoint_tensors(megatron_dist / "mcore_m8")
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
