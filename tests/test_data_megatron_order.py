"""megafp8's training-sample stream equals Megatron-Core's, sample by sample, for the same inputs.

The peer is megatron-core's own ``BlendedMegatronDatasetBuilder`` / ``GPTDataset`` / ``BlendedDataset``
(built on CPU, no process group) over the same ``.bin/.idx`` files. What is compared is what a user
sees: the tokens of every sample, Megatron's ``tokens`` plus the last of its ``labels`` against
megafp8's ``tokens`` (``seq_length + 1`` of them).
"""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

from data_fixtures import write_synthetic_dataset
from megafp8.data import blending_indices
from megafp8.data.blending_indices import exhaustive_blending_indices, greedy_blending_indices
from megafp8.data.builder import build_train_valid_test_datasets
from megafp8.data.gpt_dataset import uses_separate_final_epoch
from megafp8.data.sampler import build_pretraining_data_loader

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

SEQ_LENGTH = 64
EOD = 1


class _Tokenizer:
    """The few tokenizer attributes Megatron's dataset config reads (no pad id: Megatron then uses -1)."""

    vocab_size = 1000
    eod = EOD
    unique_identifiers = {"class": "test tokenizer"}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Three prefixes of different sizes, and one of very short (1-3 tokens) and very long documents."""
    root = tmp_path_factory.mktemp("megatron_order")
    rng = np.random.default_rng(0)
    short_and_long = np.where(rng.random(300) < 0.8, rng.integers(1, 4, 300), rng.integers(500, 3000, 300))
    lengths = {"a": rng.integers(1, 300, 397), "b": rng.integers(1, 100, 301), "c": rng.integers(1, 1000, 203),
               "short_long": short_and_long}
    for seed, (name, sizes) in enumerate(lengths.items()):
        write_synthetic_dataset(str(root / name), sizes, seed=seed)
    return {name: str(root / name) for name in lengths}


def _megatron(data_path, split, sizes, seed=1234, add_extra_token=True, seq_length=SEQ_LENGTH):
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(list(data_path)), split=split,
        tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=add_extra_token,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(MegatronGPTDataset, list(sizes), lambda: True, config).build()


def _ours(data_path, split, sizes, cache_dir, seed=1234, add_extra_token=True, seq_length=SEQ_LENGTH):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_train_valid_test_datasets(list(data_path), split, seq_length, seed, *sizes,
                                               cache_dir=str(cache_dir), add_extra_token_to_sequence=add_extra_token)


def _megatron_text(sample: dict, add_extra_token: bool = True) -> torch.Tensor:
    """The tokens a Megatron sample was cut from: its inputs plus the last label."""
    return torch.cat([sample["tokens"], sample["labels"][-1:]]) if add_extra_token else sample["tokens"]


def _assert_same_streams(theirs, ours, add_extra_token=True, sizes=(None, None, None)):
    for split, (t, o) in enumerate(zip(theirs, ours)):
        if sizes[split] == 0:  # Megatron still builds one epoch that nobody reads; megafp8 builds nothing
            assert o is None
            continue
        if t is None or len(t) == 0:
            assert o is None, f"split {split}: Megatron builds no dataset, megafp8 does"
            continue
        assert len(o) == len(t), f"split {split}: {len(o)} samples, Megatron {len(t)}"
        for i in range(len(t)):
            expected = _megatron_text(t[i], add_extra_token)
            assert torch.equal(o[i]["tokens"], expected), f"split {split}, sample {i} differs"


def test_single_prefix(corpora, tmp_path):
    for sizes in ((500, 40, None), (None, None, None), (1000, 0, 3)):
        data_path = [corpora["a"]]
        _assert_same_streams(_megatron(data_path, "90,8,2", sizes), _ours(data_path, "90,8,2", sizes, tmp_path),
                             sizes=sizes)


def test_three_epochs_with_a_separate_partial_final_epoch(corpora, tmp_path):
    data_path = [corpora["b"]]
    lengths = np.fromfile(corpora["b"] + ".idx", dtype=np.int32, count=301, offset=34)  # the .idx's lengths
    tokens_per_epoch = int(lengths[:295].sum())  # the train split of "98,2,0" holds 295 of 301 documents
    per_epoch = (tokens_per_epoch - 1) // SEQ_LENGTH
    # A third of the third epoch is used: under Megatron's 80%, so it is shuffled apart from the first two.
    partial = 2 * per_epoch + per_epoch // 3
    sizes = (partial, 40, 0)
    ours = _ours(data_path, "98,2,0", sizes, tmp_path)
    assert ours[0].num_epochs == 3 and uses_separate_final_epoch(tokens_per_epoch, partial, SEQ_LENGTH)
    _assert_same_streams(_megatron(data_path, "98,2,0", sizes), ours, sizes=sizes)
    # ...and three epochs with the last one mostly used: all shuffled together.
    almost_three = 3 * per_epoch - 3
    assert not uses_separate_final_epoch(tokens_per_epoch, almost_three, SEQ_LENGTH)
    sizes = (almost_three, 0, 0)
    _assert_same_streams(_megatron(data_path, "98,2,0", sizes), _ours(data_path, "98,2,0", sizes, tmp_path), sizes=sizes)


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.2, 0.5, 0.3), (1.0, 3.0, 2.5)])
def test_weighted_blends(corpora, tmp_path, weights):
    prefixes = [corpora[name] for name in "abc"[: len(weights)]]
    data_path = [str(x) for pair in zip(weights, prefixes) for x in pair]
    sizes = (3001, 41, 7)
    _assert_same_streams(_megatron(data_path, "90,8,2", sizes), _ours(data_path, "90,8,2", sizes, tmp_path), sizes=sizes)


def test_single_weighted_prefix_takes_megatrons_blend_path(corpora, tmp_path):
    """``--data-path 1.0 A`` is a one-member blend in Megatron (0.5% surplus, so another document order)."""
    data_path = ["1.0", corpora["a"]]
    _assert_same_streams(_megatron(data_path, "90,8,2", (900, 30, 5)), _ours(data_path, "90,8,2", (900, 30, 5), tmp_path))


def test_unweighted_list_is_weighted_by_dataset_length(corpora, tmp_path):
    data_path = [corpora["a"], corpora["b"], corpora["c"]]
    for sizes in ((700, 30, 5), (None, None, None)):  # a size caps the blend; None takes every sample once
        _assert_same_streams(_megatron(data_path, "90,8,2", sizes), _ours(data_path, "90,8,2", sizes, tmp_path),
                             sizes=sizes)


def test_very_short_and_very_long_documents(corpora, tmp_path):
    for data_path in ([corpora["short_long"]], ["0.6", corpora["short_long"], "0.4", corpora["b"]]):
        sizes = (1500, 50, 10)
        _assert_same_streams(_megatron(data_path, "80,15,5", sizes), _ours(data_path, "80,15,5", sizes, tmp_path),
                             sizes=sizes)


def test_without_the_extra_token(corpora, tmp_path):
    """``add_extra_token_to_sequence=False``: samples of exactly ``seq_length`` tokens, Megatron's ``tokens``."""
    for data_path in ([corpora["a"]], ["0.4", corpora["a"], "0.6", corpora["c"]]):
        # Another seed than the other tests: Megatron's cache key leaves this flag out, so it would reuse them.
        theirs = _megatron(data_path, "90,8,2", (800, 20, 0), seed=77, add_extra_token=False)
        ours = _ours(data_path, "90,8,2", (800, 20, 0), tmp_path, seed=77, add_extra_token=False)
        assert ours[0][0]["tokens"].shape == (SEQ_LENGTH,)
        _assert_same_streams(theirs, ours, add_extra_token=False, sizes=(800, 20, 0))


@pytest.mark.parametrize("data_path_names", [("a",), ("0.3", "a", "0.7", "b")])
def test_resume_after_k_consumed_samples_continues_megatrons_stream(corpora, tmp_path, data_path_names):
    data_path = [corpora.get(x, x) for x in data_path_names]
    theirs = _megatron(data_path, "90,8,2", (1200, 0, 0))[0]
    ours = _ours(data_path, "90,8,2", (1200, 0, 0), tmp_path)[0]
    micro_batch, dp = 3, 2
    for consumed in (0, 6, 606):
        ranks = [iter(build_pretraining_data_loader(ours, consumed, micro_batch, rank, dp)) for rank in range(dp)]
        for step in range(4):  # one global batch = the micro-batches of all DP ranks, in rank order
            batch = torch.cat([next(r)["tokens"] for r in ranks])
            first = consumed + step * micro_batch * dp
            expected = torch.stack([_megatron_text(theirs[k]) for k in range(first, first + micro_batch * dp)])
            assert torch.equal(batch, expected), f"consumed {consumed}, step {step}"


@pytest.mark.parametrize("compiled", [True, False])
def test_blending_indices_equal_megatrons_cpp(compiled):
    if compiled:
        if shutil.which("cc") is None and shutil.which("gcc") is None:
            pytest.skip("no C compiler: only the pure-Python blending loop is available")
        assert blending_indices._load_library() is not None  # really the compiled path, not the fallback
    rng = np.random.default_rng(5)
    cases = [[0.3, 0.7], [0.2, 0.5, 0.3], [1 / 3] * 3, [0.1] * 10, rng.random(7), rng.random(40)]
    for weights in cases:
        weights = (np.asarray(weights, dtype=np.float64) / np.sum(weights)).tolist()
        size = 20000 if compiled else 3000
        theirs = (np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64))
        helpers.build_blending_indices(theirs[0], theirs[1], weights, len(weights), size, False)
        ours = greedy_blending_indices(weights, size, compiled=compiled)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    for sizes in ([5, 3], [700, 1, 33, 250], rng.integers(1, 300, 12)):
        sizes = np.asarray(sizes, dtype=np.int64)
        theirs = (np.zeros(sizes.sum(), dtype=np.int16), np.zeros(sizes.sum(), dtype=np.int64))
        helpers.build_exhaustive_blending_indices(theirs[0], theirs[1], sizes, len(sizes))
        ours = exhaustive_blending_indices(sizes, compiled=compiled)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])


def test_without_a_compiler_the_python_loop_gives_the_same_blend(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAFP8_CACHE_DIR", str(tmp_path))  # no compiled helper cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(blending_indices, "_library", None)
    monkeypatch.setattr(blending_indices, "_compile_failed", False)
    with pytest.warns(UserWarning, match="blending indices are built in pure Python"):
        ours = greedy_blending_indices([0.25, 0.45, 0.3], 5000)
    theirs = (np.zeros(5000, dtype=np.int16), np.zeros(5000, dtype=np.int64))
    helpers.build_blending_indices(theirs[0], theirs[1], [0.25, 0.45, 0.3], 3, 5000, False)
    assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])


@pytest.mark.parametrize("trial", range(4))
def test_random_corpora_splits_and_blends(tmp_path, trial):
    """Random document lengths, dataset counts, weights, splits, seeds and sequence lengths."""
    rng = np.random.default_rng(100 + trial)
    prefixes = []
    for k in range(int(rng.integers(1, 4))):
        prefixes.append(str(tmp_path / f"d{k}"))
        write_synthetic_dataset(prefixes[-1], rng.integers(1, rng.integers(5, 800), rng.integers(50, 300)), seed=k)
    weighted = len(prefixes) > 1 and trial % 2 == 0
    data_path = [str(x) for p in prefixes for x in (round(float(rng.random()) + 0.05, 3), p)] if weighted else prefixes
    split = ["98,2,0", "7,2,1", "90,5,5", "33,33,34"][trial]
    sizes = (int(rng.integers(100, 2500)), int(rng.integers(1, 100)), int(rng.integers(1, 30)))
    seed, seq_length = int(rng.integers(0, 2**31)), int(rng.choice([8, 31, 128]))
    theirs = _megatron(data_path, split, sizes, seed=seed, seq_length=seq_length)
    ours = _ours(data_path, split, sizes, tmp_path / "cache", seed=seed, seq_length=seq_length)
    _assert_same_streams(theirs, ours, sizes=sizes)
