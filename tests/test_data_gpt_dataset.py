"""GPT samples, their index cache, splits, blending and resumable sampling."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from data_fixtures import write_synthetic_dataset
from megafp8.data.blended_dataset import build_blending_indices
from megafp8.data.builder import build_train_valid_test_datasets, parse_data_path
from megafp8.data.gpt_dataset import GPTDataset, build_document_index, build_sample_index
from megafp8.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megafp8.data.sampler import PretrainingSampler, build_pretraining_data_loader
from megafp8.data.splits import parse_split, split_ranges


def _unique_token_dataset(prefix: str, lengths) -> list[np.ndarray]:
    """Documents whose tokens are all distinct, so a token identifies its document and position."""
    tokens = np.random.default_rng(7).permutation(int(np.sum(lengths))).astype(np.int32)
    documents = np.split(tokens, np.cumsum(lengths)[:-1])
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in documents:
            writer.add_document(doc)
        writer.finalize()
    return documents


def test_one_epoch_covers_every_token_of_the_selected_documents(tmp_path):
    seq_length = 16
    lengths = np.random.default_rng(0).integers(0, 60, size=120)
    selected = np.arange(20, 100)
    # Make the selected documents hold exactly n * seq_length + 1 tokens: then nothing is dropped.
    lengths[selected[-1]] += (1 - lengths[selected].sum()) % seq_length
    documents = _unique_token_dataset(str(tmp_path / "u"), lengths)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "u")), selected, None, seq_length, seed=3,
                    cache_dir=str(tmp_path / "cache"))
    expected_tokens = np.concatenate([documents[i] for i in selected])
    assert len(ds) == (len(expected_tokens) - 1) // seq_length

    samples = [ds.sample(i) for i in range(len(ds))]
    assert all(s.shape == (seq_length + 1,) and s.dtype == np.int64 for s in samples)
    seen = np.concatenate(samples)
    assert np.array_equal(np.unique(seen), np.sort(expected_tokens))  # every token, nothing else
    # Each token appears once, except the one shared by consecutive samples (last of i = first of i+1).
    assert len(seen) == len(expected_tokens) + len(ds) - 1
    # Within a sample, tokens are consecutive in their documents (samples cut across boundaries).
    position = {int(t): (d, k) for d in selected for k, t in enumerate(documents[d])}
    for sample in samples[:20]:
        for a, b in zip(sample[:-1], sample[1:]):
            (da, ka), (db, kb) = position[int(a)], position[int(b)]
            assert (da == db and kb == ka + 1) or (da != db and ka == len(documents[da]) - 1 and kb == 0)


def test_sample_index_matches_megatron_cpp(tmp_path):
    """Same document order in, same sample index out as Megatron-Core's compiled build_sample_idx."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helpers = pytest.importorskip("megatron.core.datasets.helpers")
    lengths = np.random.default_rng(1).integers(0, 40, size=500).astype(np.int32)  # includes empty documents
    lengths[[3, 4]] = 0  # documents that end exactly where a sample does are stepped over
    for seq_length, epochs in ((1, 1), (7, 2), (64, 3), (5, 1)):
        document_index = build_document_index(np.arange(500), epochs, np.random.RandomState(2))
        # Let the index start with empty documents: Megatron still records (0, 0) for sample 0.
        for row, document in enumerate((3, 4)):
            where = np.flatnonzero(document_index == document)[0]
            document_index[[row, where]] = document_index[[where, row]]
        for extra in (True, False):
            theirs = helpers.build_sample_idx(lengths, document_index, seq_length, epochs,
                                              int(lengths.sum()), True, extra)
            np.testing.assert_array_equal(build_sample_index(lengths, document_index, seq_length, None, extra), theirs)
            ours = build_sample_index(lengths, document_index, seq_length, theirs.shape[0] - 1, extra)
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_epochs_mix_and_a_small_final_epoch_is_shuffled_apart(tmp_path):
    write_synthetic_dataset(str(tmp_path / "d"), [30] * 10)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), np.arange(10), 100, 8, seed=0, cache_dir=None)
    # 100 * 8 + 1 tokens need 3 epochs of 300; whole epochs are built: (900 - 1) // 8 samples.
    assert ds.num_epochs == 3 and len(ds) == 112 and ds.num_samples == 100
    # 26 samples come from the third epoch (74 from the first two), under 80% of its 37: it is separate.
    document_index = np.asarray(ds.document_index)
    assert np.array_equal(np.bincount(document_index[:20]), [2] * 10)  # two epochs shuffled together
    assert sorted(document_index[20:]) == list(range(10))
    assert not np.array_equal(np.sort(document_index[:10]), np.arange(10))  # ...so the first 10 rows mix them
    shuffle_index = np.asarray(ds.shuffle_index)
    assert sorted(shuffle_index[:74]) == list(range(74)) and sorted(shuffle_index[74:]) == list(range(74, 112))
    # 90 samples take 16 of the third epoch's 37, still under 80%; 110 take 36: then all three mix.
    whole = GPTDataset(IndexedDataset(str(tmp_path / "d")), np.arange(10), 110, 8, seed=0, cache_dir=None)
    assert whole.shuffle_index[:74].max() >= 74


def test_deterministic_for_a_seed(tmp_path):
    write_synthetic_dataset(str(tmp_path / "d"), np.random.default_rng(4).integers(1, 80, size=50))
    data = IndexedDataset(str(tmp_path / "d"))
    a = GPTDataset(data, np.arange(50), 60, 12, seed=5, cache_dir=str(tmp_path / "c1"))
    b = GPTDataset(data, np.arange(50), 60, 12, seed=5, cache_dir=str(tmp_path / "c2"))
    c = GPTDataset(data, np.arange(50), 60, 12, seed=6, cache_dir=str(tmp_path / "c3"))
    assert all(np.array_equal(a.sample(i), b.sample(i)) for i in range(60))
    assert not all(np.array_equal(a.sample(i), c.sample(i)) for i in range(60))


def test_cache_is_reused_and_invalidated(tmp_path):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    write_synthetic_dataset(prefix, [50] * 20)

    def build(seq_length=16, num_samples=30, seed=1, extra=True):
        return GPTDataset(IndexedDataset(prefix), np.arange(20), num_samples, seq_length, seed=seed, cache_dir=cache,
                          add_extra_token_to_sequence=extra)

    first = build()
    assert not first.cache_hit and build().cache_hit
    assert all(np.array_equal(first.sample(i), build().sample(i)) for i in range(5))
    assert not build(seq_length=32).cache_hit  # a parameter changed: rebuilt, never the old arrays
    assert len(build(seq_length=32)[0]["tokens"]) == 33
    assert not build(num_samples=31).cache_hit
    assert not build(seed=2).cache_hit
    assert not build(extra=False).cache_hit and len(build(extra=False)[0]["tokens"]) == 16

    write_synthetic_dataset(prefix, [50] * 19 + [51])  # the data changed under the same prefix
    assert not build().cache_hit
    files = os.listdir(cache)
    assert len([f for f in files if f.endswith("description.json")]) == 6 and not any(".tmp" in f for f in files)


def test_too_little_data_is_a_clear_error(tmp_path):
    write_synthetic_dataset(str(tmp_path / "d"), [3, 4])
    with pytest.raises(ValueError, match="not enough for one sample of --seq-length 64"):
        GPTDataset(IndexedDataset(str(tmp_path / "d")), np.arange(2), None, 64, seed=0)


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    ranges = split_ranges(7, parse_split("1,1,1"))
    assert ranges[0][0] == 0 and ranges[-1][1] == 7 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_blending_indices_track_the_weights_at_every_prefix():
    weights = [0.2, 0.5, 0.3]
    dataset_index, dataset_sample_index = build_blending_indices(weights, 20000)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[dataset_index], axis=0)
    n = np.arange(1, 20001)[:, None]
    assert np.abs(counts - n * np.array(weights)).max() <= 1.0
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == d], np.arange(counts[-1, d]))


def test_train_valid_test_blend_proportions(tmp_path):
    write_synthetic_dataset(str(tmp_path / "a"), [40] * 300, seed=1)
    write_synthetic_dataset(str(tmp_path / "b"), [25] * 700, seed=2)
    data_path = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    train, valid, test = build_train_valid_test_datasets(data_path, "969,30,1", 32, 1234, 4000, 64, 0)
    # Megatron sizes a weighted blend as the sum of each member's share rounded up: 64 -> 20 + 45.
    assert (len(train), len(valid), test) == (4000, 65, None)
    shares = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert np.abs(shares - [0.3, 0.7]).max() < 0.01
    assert train[0]["tokens"].shape == (33,) and train[0]["tokens"].dtype == torch.int64
    # the caches landed beside the data and a second build reuses them
    assert os.path.isdir(tmp_path / "cache")
    again = build_train_valid_test_datasets(data_path, "969,30,1", 32, 1234, 4000, 64, 0)[0]
    assert all(m.cache_hit for m in again.datasets)
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 4000, 397))


def test_single_dataset_splits_are_disjoint(tmp_path):
    documents = _unique_token_dataset(str(tmp_path / "u"), [30] * 100)
    train, valid, test = build_train_valid_test_datasets([str(tmp_path / "u")], "80,10,10", 16, 0, None, None, None)
    token_sets = [set(np.concatenate([ds.sample(i) for i in range(len(ds))]).tolist()) for ds in (train, valid, test)]
    assert not (token_sets[0] & token_sets[1]) and not (token_sets[1] & token_sets[2])
    assert token_sets[2] <= set(np.concatenate(documents[90:]).tolist())
    assert build_train_valid_test_datasets([str(tmp_path / "u")], "100,0,0", 16, 0, 10, 10, 10)[1:] == (None, None)


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["missing/prefix"], "missing/prefix.idx not found"),
        (["0.5", "A", "B"], "WEIGHT PREFIX pairs"),
        (["-1", "A"], "weights must be positive"),
        ([], "--data-path"),
    ],
)
def test_bad_data_path(data_path, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(data_path)


def test_sampler_resumes_exactly_and_shards_by_rank():
    uninterrupted = [i for batch in PretrainingSampler(100, 0, 4) for i in batch]
    assert uninterrupted == list(range(100))
    resumed = [i for batch in PretrainingSampler(100, 37, 4) for i in batch]
    assert resumed == uninterrupted[37:37 + len(resumed)] and len(resumed) == 60  # last partial batch dropped
    ranks = [list(PretrainingSampler(100, 8, 2, data_parallel_rank=r, data_parallel_size=3)) for r in range(3)]
    assert ranks[0][0] == [8, 9] and ranks[1][0] == [10, 11] and ranks[2][0] == [12, 13]
    assert len(ranks[0]) == len(PretrainingSampler(100, 8, 2, 0, 3)) == 15
    with pytest.raises(ValueError, match="consumed_samples 101"):
        PretrainingSampler(100, 101, 4)


def test_data_loader_resume_matches_uninterrupted_run(tmp_path):
    write_synthetic_dataset(str(tmp_path / "d"), [64] * 40)
    train = build_train_valid_test_datasets([str(tmp_path / "d")], "1", 16, 9, 120, 0, 0)[0]
    full = [b["tokens"] for b in build_pretraining_data_loader(train, 0, micro_batch_size=4)]
    resumed = [b["tokens"] for b in build_pretraining_data_loader(train, 40, micro_batch_size=4, num_workers=1)]
    assert full[0].shape == (4, 17) and len(resumed) == len(full) - 10
    assert all(torch.equal(a, b) for a, b in zip(full[10:], resumed))


def test_blend_split_without_documents_from_a_member(tmp_path):
    """1/1000 of 300 documents rounds to none: the test split is blended from the other member alone."""
    write_synthetic_dataset(str(tmp_path / "a"), [40] * 300, seed=1)
    write_synthetic_dataset(str(tmp_path / "b"), [25] * 700, seed=2)
    data_path = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    with pytest.warns(UserWarning, match="test split .* has no documents from .*a; it is blended from the other"):
        test = build_train_valid_test_datasets(data_path, "969,30,1", 16, 0, 0, 0, None)[2]
    assert len(test) == (25 - 1) // 16 and set(np.asarray(test.dataset_index).tolist()) == {0}


def test_datasets_pickle_cached_indices_by_path(tmp_path):
    """Data-loader workers get the .npy paths, not copies of the (possibly GB-sized) index arrays."""
    import pickle

    write_synthetic_dataset(str(tmp_path / "a"), [40] * 100, seed=1)
    write_synthetic_dataset(str(tmp_path / "b"), [40] * 100, seed=2)
    data_path = ["0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b")]
    small, large = (build_train_valid_test_datasets(data_path, "1", 16, 0, n, 0, 0)[0] for n in (300, 3000))
    assert len(pickle.dumps(large)) - len(pickle.dumps(small)) < 64  # size does not grow with the samples
    clone = pickle.loads(pickle.dumps(large))
    assert all(torch.equal(clone[i]["tokens"], large[i]["tokens"]) for i in range(0, 3000, 337))
