"""The .bin/.idx format: exact bytes, reading back, corrupt-file detection, atomic writes, merging, and
interoperability with Megatron-Core's own IndexedDataset (when the `megatron-core` package imports)."""
from __future__ import annotations

import os
import struct
import warnings

import numpy as np
import pytest

from data_fixtures import write_synthetic_dataset
from megafp8.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    merge_indexed_datasets,
    optimal_dtype,
)


def _megatron_indexed_dataset_module():
    """megatron.core.datasets.indexed_dataset, or a clean skip when the peer library is unavailable."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that Transformer Engine and Apex are absent
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_idx_bytes_match_the_format_spec(tmp_path):
    """Three documents of uint16 tokens; the expected bytes are spelled out from the format, not the code."""
    prefix = str(tmp_path / "tiny")
    docs = [[5, 6, 7], [8], [9, 10]]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
        writer.finalize()

    expected_idx = (
        b"MMIDIDX\x00\x00"                   # magic
        + struct.pack("<Q", 1)               # version
        + struct.pack("<B", 8)               # dtype code 8 = uint16
        + struct.pack("<Q", 3)               # sequence count
        + struct.pack("<Q", 4)               # document count + 1
        + struct.pack("<3i", 3, 1, 2)        # int32 sequence lengths
        + struct.pack("<3q", 0, 6, 8)        # int64 byte pointers: 2 bytes per uint16 token
        + struct.pack("<4q", 0, 1, 2, 3)     # int64 document indices, starting at 0
    )
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == expected_idx
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == struct.pack("<6H", 5, 6, 7, 8, 9, 10)


def test_reader_returns_each_document(tmp_path):
    prefix = str(tmp_path / "ds")
    docs = write_synthetic_dataset(prefix, [0, 3, 17, 1, 250], vocab_size=1000)
    ds = IndexedDataset(prefix)
    assert len(ds) == 5 and ds.num_documents == 5 and ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(4, offset=10, length=5), docs[4][10:15])
    assert ds.num_tokens == sum(len(d) for d in docs)


def test_dtype_follows_vocab_size():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32  # Megatron's threshold, not 65536


def _corrupt(tmp_path, edit) -> str:
    prefix = str(tmp_path / "ds")
    write_synthetic_dataset(prefix, [4, 5, 6])
    edit(prefix)
    return prefix


def _rewrite(path: str, transform) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(transform(data))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: _rewrite(p + ".idx", lambda d: b"NOTANIDX\x00" + d[9:]), "bad magic"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:]), "unsupported index version 2"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:17] + b"\x63" + d[18:]), "unknown dtype code 99"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:20]), "truncated index"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:-8]), "sizes don't add up"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:18] + struct.pack("<Q", 7) + d[26:]), "sizes don't add up"),
        (lambda p: _rewrite(p + ".bin", lambda d: d[:-2]), "sizes don't add up"),
        (lambda p: _rewrite(p + ".bin", lambda d: d + b"\x00\x00"), "sizes don't add up"),
        # pointer of sequence 1 (after 34 header bytes and 3 int32 lengths) changed from 8 to 10
        (lambda p: _rewrite(p + ".idx", lambda d: d[:54] + struct.pack("<q", 10) + d[62:]), "byte pointer of sequence 1"),
        (lambda p: _rewrite(p + ".idx", lambda d: d[:-8] + struct.pack("<q", 2)), "corrupt document indices"),
        (lambda p: os.remove(p + ".bin"), "data file not found"),
        (lambda p: os.remove(p + ".idx"), "index file not found"),
    ],
    ids=["magic", "version", "dtype", "truncated-header", "truncated-idx", "wrong-count", "truncated-bin",
         "long-bin", "pointer", "document-indices", "missing-bin", "missing-idx"],
)
def test_corrupt_dataset_fails_at_open_naming_the_file(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    assert prefix in str(info.value)


def test_interrupted_write_leaves_nothing_under_the_final_name(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("killed mid-run")
    assert os.listdir(tmp_path) == []


def test_unfinished_write_is_invisible(tmp_path):
    prefix = str(tmp_path / "ds")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    writer.finalize()
    assert IndexedDataset(prefix)[0].tolist() == [1, 2, 3]


def test_merge_concatenates_in_order(tmp_path):
    a = write_synthetic_dataset(str(tmp_path / "a"), [3, 0, 9], seed=1)
    b = write_synthetic_dataset(str(tmp_path / "b"), [5, 2], seed=2)
    merged = merge_indexed_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out" / "m"))
    assert merged.num_documents == 5
    assert merged.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    for i, doc in enumerate(a + b):
        np.testing.assert_array_equal(merged[i], doc)


def test_merge_rejects_mixed_dtypes(tmp_path):
    write_synthetic_dataset(str(tmp_path / "small"), [3], vocab_size=100)
    write_synthetic_dataset(str(tmp_path / "big"), [3], vocab_size=70000)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge_indexed_datasets([str(tmp_path / "small"), str(tmp_path / "big")], str(tmp_path / "m"))
    assert not os.path.exists(str(tmp_path / "m.idx"))


def test_megatron_reads_our_files(tmp_path):
    megatron = _megatron_indexed_dataset_module()
    for vocab in (1000, 70000):  # uint16 and int32 files
        prefix = str(tmp_path / f"ours{vocab}")
        docs = write_synthetic_dataset(prefix, [7, 1, 0, 30], vocab_size=vocab)
        theirs = megatron.IndexedDataset(prefix)
        assert len(theirs) == len(docs)
        np.testing.assert_array_equal(theirs.document_indices, [0, 1, 2, 3, 4])
        for i, doc in enumerate(docs):
            np.testing.assert_array_equal(theirs[i], doc)


def test_we_read_megatron_files(tmp_path):
    megatron = _megatron_indexed_dataset_module()

    prefix = str(tmp_path / "theirs")
    docs = [np.arange(n, dtype=np.int64) + 3 for n in (4, 1, 12)]
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.uint16 and ours.num_documents == 3
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ours[i], doc)
    # Byte-for-byte: the same documents through our writer give identical files.
    with IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
        writer.finalize()
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as f, open(str(tmp_path / "ours") + ext, "rb") as g:
            assert f.read() == g.read(), ext


def test_token_id_range_is_read_once_and_cached(tmp_path, monkeypatch):
    """token_range_error: the smallest and largest id over every chunk of the .bin, checked against the
    vocabulary; the second start reads the cached verdict (keyed by the dataset's fingerprint), not the data."""
    from megafp8.data import token_range

    prefix = str(tmp_path / "ids")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_document(np.array([5, 7, 9], dtype=np.int32))
        writer.add_document(np.array([1, 4242, 3], dtype=np.int32))
        writer.finalize()
    assert IndexedDataset(prefix).token_id_range(chunk=2) == (1, 4242)
    cache = str(tmp_path / "cache")
    assert token_range.token_range_error(prefix, 4243, cache) is None
    monkeypatch.setattr(IndexedDataset, "token_id_range", lambda self, chunk=0: pytest.fail("read the data again"))
    error = token_range.token_range_error(prefix, 1000, cache)
    assert error == (f"--data-path {prefix}: token id 4242 is past the tokenizer's vocabulary (1000 ids: 0 .. 999); "
                     "was it preprocessed with another tokenizer or --vocab-size?")
    monkeypatch.undo()
    negative = str(tmp_path / "negative")
    with IndexedDatasetWriter(negative, np.int32) as writer:
        writer.add_document(np.array([3, -1], dtype=np.int32))
        writer.finalize()
    assert "token id -1 is negative" in token_range.token_range_error(negative, 1000, None)
