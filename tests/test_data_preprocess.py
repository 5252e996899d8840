"""tools/preprocess_data.py and its engine: exact round trip, bad input, --strict, partitions and merging."""
from __future__ import annotations

import json
from pathlib import Path
import os

import numpy as np
import pytest

from data_fixtures import read_texts, run_tool, small_corpus, sp_model, write_lines  # noqa: F401 (fixtures)
from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.preprocess import PreprocessError, preprocess
from megafp8.data.tokenizer import NullTokenizer, SentencePieceTokenizer


def _docs(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_round_trip_two_workers_via_the_tool(tmp_path, small_corpus, sp_model):
    """Documents → preprocess (2 workers, small chunks so both work) → exactly the tokenizer's ids + eod."""
    tok = SentencePieceTokenizer(sp_model)
    expected = [tok.tokenize(text) + [tok.eod] for text in read_texts(small_corpus)]
    summary = preprocess(small_corpus, str(tmp_path / "lib"), tok, append_eod=True, workers=2,
                         progress=False, chunk_bytes=16 << 10)
    assert _docs(str(tmp_path / "lib_text_document")) == expected
    assert summary.documents["text"] == len(expected) and not summary.problem_counts

    # The command line a user types gives the same bytes.
    result = run_tool("preprocess_data.py", "--input", small_corpus, "--output-prefix", str(tmp_path / "cli"),
                      "--json-keys", "text", "--tokenizer-type", "SentencePieceTokenizer",
                      "--tokenizer-model", sp_model, "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "MB/s" in result.stdout
    for ext in (".bin", ".idx"):
        with open(str(tmp_path / "lib_text_document") + ext, "rb") as f, \
                open(str(tmp_path / "cli_text_document") + ext, "rb") as g:
            assert f.read() == g.read()


@pytest.mark.parametrize("use_threads, workers, numpy_batches",
                         [(True, 2, True), (True, 1, True), (True, 2, False), (False, 2, True), (False, 1, True)])
def test_output_is_byte_identical_to_megatron_core_builder(tmp_path, small_corpus, sp_model, use_threads, workers,
                                                           numpy_batches):
    """Both engines (tokenizing thread, worker processes) write exactly what Megatron-LM's preprocess_data.py
    writes: Megatron-Core's IndexedDatasetBuilder fed one ``tokenize(text) + [eod]`` per document."""
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tok = SentencePieceTokenizer(sp_model)
    tok._numpy_batches = numpy_batches  # False: the list path of sentencepiece < 0.2.1
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=np.uint16)
    for text in read_texts(small_corpus):
        ids = tok.tokenize(text) + [tok.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(str(tmp_path / "megatron.idx"))

    preprocess(small_corpus, str(tmp_path / "ours"), tok, append_eod=True, workers=workers, progress=False,
               chunk_bytes=16 << 10, use_threads=use_threads)
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"megatron{ext}", "rb") as f, open(tmp_path / f"ours_text_document{ext}", "rb") as g:
            assert f.read() == g.read()


def test_without_eod_and_several_keys(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"text": "1 2 3", "title": "7"}),
        json.dumps({"text": "4", "title": "8 9"}),
    ])
    preprocess(path, str(tmp_path / "out"), NullTokenizer(10), json_keys=["text", "title"], progress=False)
    assert _docs(str(tmp_path / "out_text_document")) == [[1, 2, 3], [4]]
    assert _docs(str(tmp_path / "out_title_document")) == [[7], [8, 9]]


def test_large_vocab_writes_int32(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "70000 5"})])
    preprocess(path, str(tmp_path / "out"), NullTokenizer(70000), append_eod=True, progress=False)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [70000, 5, 70000]


BAD_LINES = [
    json.dumps({"text": "1 2"}),                    # line 1: good
    '{"text": "3 4"',                               # line 2: malformed JSON
    json.dumps({"title": "5"}),                     # line 3: missing key
    b'{"text": "6 \xff 7"}',                        # line 4: not UTF-8
    json.dumps({"text": ""}),                       # line 5: empty document
    json.dumps({"text": 8}),                        # line 6: value not a string
    "",                                             # line 7: blank (not an error)
    json.dumps(["text", "9"]),                      # line 8: JSON but not an object
    json.dumps({"text": "10 11"}),                  # line 9: good
]


def test_bad_lines_are_skipped_and_reported_with_line_numbers(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    summary = preprocess(path, str(tmp_path / "out"), NullTokenizer(20), append_eod=True, progress=False)
    assert _docs(str(tmp_path / "out_text_document")) == [[1, 2, 20], [10, 11, 20]]
    assert dict(summary.problem_counts) == {
        "malformed_json": 2, "missing_key": 1, "not_utf8": 1, "empty": 1, "not_string": 1,
    }
    report = summary.report(path)
    for expected in ("skipped 6 bad document(s)", "malformed JSON: line 2", "line 8 (a JSON list, not an object)",
                     "missing key: line 3 ('text'; keys present: 'title')", "not valid UTF-8: line 4 (byte 0xff at column 13)",
                     "empty document: line 5", "value is not a string: line 6 ('text' is int)"):
        assert expected in report, report


def test_bad_lines_through_the_tool(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    args = ["--input", path, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "20", "--append-eod", "--workers", "2"]
    result = run_tool("preprocess_data.py", *args)
    assert result.returncode == 0 and "malformed JSON: line 2" in result.stderr
    assert "2 documents" in result.stdout

    os.remove(str(tmp_path / "out_text_document.idx"))
    result = run_tool("preprocess_data.py", *args, "--strict")
    assert result.returncode == 1
    assert f"error: {path}:2: malformed JSON" in result.stderr and "--strict" in result.stderr
    assert not os.path.exists(str(tmp_path / "out_text_document.idx"))  # nothing under the final name
    assert not os.path.exists(str(tmp_path / "out_text_document.bin.tmp"))


@pytest.mark.parametrize("line_number", range(2, 7))
def test_strict_fails_on_each_kind_of_bad_line(tmp_path, line_number):
    lines = [BAD_LINES[0], BAD_LINES[line_number - 1]]
    path = write_lines(tmp_path / "one_bad.jsonl", lines)
    with pytest.raises(PreprocessError, match=f"one_bad.jsonl:2: "):
        preprocess(path, str(tmp_path / "out"), NullTokenizer(20), strict=True, progress=False)
    assert os.listdir(tmp_path) == ["one_bad.jsonl"]


def test_line_numbers_are_global_across_chunks_and_workers(tmp_path):
    lines = [json.dumps({"text": f"{i % 50} 1"}) for i in range(3000)]
    lines[2500] = "{broken"
    path = write_lines(tmp_path / "in.jsonl", lines)
    summary = preprocess(path, str(tmp_path / "out"), NullTokenizer(50), workers=2, progress=False, chunk_bytes=4096)
    assert summary.problem_examples["malformed_json"][0][0] == 2501
    assert summary.documents["text"] == 2999


def test_partitions_then_merge_equal_one_run(tmp_path, small_corpus, sp_model):
    tok = SentencePieceTokenizer(sp_model)
    preprocess(small_corpus, str(tmp_path / "whole"), tok, append_eod=True, progress=False)
    parts = []
    for index in range(3):
        result = run_tool("preprocess_data.py", "--input", small_corpus, "--output-prefix",
                          str(tmp_path / "parts" / f"p{index}"), "--tokenizer-type", "SentencePieceTokenizer",
                          "--tokenizer-model", sp_model, "--append-eod", "--partitions", "3",
                          "--partition-index", str(index))
        assert result.returncode == 0, result.stderr
        parts.append(str(tmp_path / "parts" / f"p{index}_text_document"))
    assert all(len(IndexedDataset(p)) > 0 for p in parts)
    result = run_tool("merge_datasets.py", "--input", str(tmp_path / "parts"), "--output-prefix",
                      str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    for ext in (".bin", ".idx"):
        with open(str(tmp_path / "whole_text_document") + ext, "rb") as f, open(str(tmp_path / "merged") + ext, "rb") as g:
            assert f.read() == g.read()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_path": "/nonexistent.jsonl"}, "--input /nonexistent.jsonl: no such file"),
        ({"workers": 0}, "--workers 0"),
        ({"partitions": 2, "partition_index": 2}, "--partition-index 2"),
        ({"json_keys": []}, "--json-keys"),
    ],
)
def test_bad_arguments_name_the_flag(tmp_path, kwargs, message):
    path = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "1"})])
    args = {"input_path": path, "output_prefix": str(tmp_path / "out"), "tokenizer": NullTokenizer(5), "progress": False}
    args.update(kwargs)
    with pytest.raises(PreprocessError, match=message):
        preprocess(**args)


def test_missing_eos_with_append_eod_is_an_error(tmp_path, small_corpus):
    import sentencepiece as spm

    prefix = str(tmp_path / "noeos")
    spm.SentencePieceTrainer.Train(input=small_corpus, model_prefix=prefix, vocab_size=400, eos_id=-1,
                                   minloglevel=2, byte_fallback=True)
    with pytest.raises(PreprocessError, match="--append-eod"):
        preprocess(small_corpus, str(tmp_path / "o"), SentencePieceTokenizer(prefix + ".model"), append_eod=True)


@pytest.mark.parametrize("use_threads", [True, False], ids=["thread", "processes"])
def test_huggingface_tokenizer_round_trip(tmp_path, small_corpus, use_threads):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megafp8.data.tokenizer import HuggingFaceTokenizer

    fast = Tokenizer(models.BPE(unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = read_texts(small_corpus)
    fast.train_from_iterator(texts[:5], trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "</s>"]))
    fast.save(str(tmp_path / "tokenizer.json"))
    tok = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    preprocess(small_corpus, str(tmp_path / "hf"), tok, append_eod=True, workers=2, progress=False,
               chunk_bytes=64 << 10, use_threads=use_threads)
    expected = [fast.encode(t, add_special_tokens=False).ids + [1] for t in texts]
    assert _docs(str(tmp_path / "hf_text_document")) == expected


def _preprocess_null(path: str, prefix: str, *extra: str):
    return run_tool("preprocess_data.py", "--input", path, "--output-prefix", prefix, "--tokenizer-type",
                    "NullTokenizer", "--vocab-size", "20", "--append-eod", *extra)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "the file is empty"),
        (["", "  "], "only blank lines"),
        ([json.dumps({"content": "1 2"}), json.dumps({"content": "3"})],
         "no documents for key 'text': every line was skipped (check --json-keys)"),
        (['{"text": "1 2"', "[1, 2]"], "no documents for key 'text': every line was skipped"),
        ([b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"], "binary data (a NUL byte at offset 8)"),
        ([b"\x1f\x8b\x08\x00\x00\x00"], "gzip-compressed data"),
    ],
    ids=["empty", "blank", "missing-key", "malformed", "binary", "gzip"],
)
def test_zero_documents_is_an_error_naming_the_cause(tmp_path, lines, message):
    path = write_lines(tmp_path / "in.jsonl", lines) if lines else str(tmp_path / "in.jsonl")
    if not lines:
        open(path, "wb").close()
    for workers in ("1", "2"):  # the process engine (NullTokenizer) and the inline one
        result = _preprocess_null(path, str(tmp_path / "out" / "x"), "--workers", workers)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"error: --input {path}: " in result.stderr and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []  # nothing written


def test_zero_documents_with_a_sentencepiece_tokenizer(tmp_path, sp_model):
    """The threaded engine reports the same way, and names the key that got no documents."""
    path = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "def f(): pass"}) for _ in range(3)])
    tok = SentencePieceTokenizer(sp_model)
    with pytest.raises(PreprocessError, match="no documents for key 'title'.*check --json-keys"):
        preprocess(path, str(tmp_path / "out"), tok, json_keys=["text", "title"], workers=2, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_user_errors_about_paths_are_one_clear_line(tmp_path):
    data = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "1 2"})])
    result = _preprocess_null(str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 1 and f"error: --input {tmp_path}: is a directory" in result.stderr

    result = _preprocess_null(data, str(tmp_path / "in.jsonl" / "sub" / "out"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--output-prefix {tmp_path / 'in.jsonl' / 'sub' / 'out'}: {data} is a file" in result.stderr


def test_merge_errors_name_the_missing_directory_or_prefix(tmp_path, small_corpus, sp_model):
    missing = str(tmp_path / "parts")
    result = run_tool("merge_datasets.py", "--input", missing, "--output-prefix", str(tmp_path / "merged"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: --input {missing}: no such directory, and no dataset {missing}.idx/.bin" in result.stderr
    assert ".idx: index file not found" not in result.stderr

    preprocess(small_corpus, str(tmp_path / "a"), SentencePieceTokenizer(sp_model), progress=False)
    result = run_tool("merge_datasets.py", "--input", str(tmp_path / "a_text_document"), str(tmp_path / "b"),
                      "--output-prefix", str(tmp_path / "merged"))
    assert result.returncode == 1 and f"--input {tmp_path / 'b'}: no such directory" in result.stderr

    # A prefix given with its extension is accepted; an output under a file is one clear line.
    result = run_tool("merge_datasets.py", "--input", str(tmp_path / "a_text_document.idx"),
                      "--output-prefix", str(tmp_path / "a_text_document.bin" / "merged"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'a_text_document.bin'} is a file" in result.stderr


HOSTILE_LINES = [
    '{"text": "1 2"}',
    '{"text": "-1 65535 70000"}',       # NullTokenizer ids outside 0 .. 20: stored as uint16 they wrapped
    '{"text": "3 abc"}',                # not an id
    '{"text": "' + "9" * 23 + '"}',     # a 23-digit integer
    '{"text": "a\\ud800b"}',            # valid JSON, a lone surrogate: no tokenizer takes it
    '{"text": ' + "[" * 200_000,        # an object nested past the parser's recursion limit
    '{"text": "4 5"}',
]


@pytest.mark.parametrize("workers", [1, 2])
def test_hostile_lines_are_skipped_or_fatal_with_one_line_through_the_tool(tmp_path, workers):
    """Issue 38 items 3 and 7: bad ids, non-ids, a lone surrogate and deep nesting are bad lines like any other
    (skipped and reported, or one error line under --strict), never a traceback or a wrapped id."""
    path = write_lines(tmp_path / "hostile.jsonl", HOSTILE_LINES)
    args = ["--input", path, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "20", "--append-eod", "--workers", str(workers)]
    result = run_tool("preprocess_data.py", *args)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert _docs(str(tmp_path / "out_text_document")) == [[1, 2, 20], [4, 5, 20]]
    for expected in ("the tokenizer refused it: line 2", "token id -1 is outside the vocabulary (0 .. 20",
                     "line 3 ('text': 'abc' is not a token id", "line 4 ('text': token id 99999999999999999999999",
                     "not valid UTF-8: line 5",
                     "malformed JSON: line 6 (nested too deeply)"):
        assert expected in result.stderr, (expected, result.stderr[-3000:])
    for bad in (2, 5, 6):
        lines = [HOSTILE_LINES[0], HOSTILE_LINES[bad - 1]]
        one = write_lines(tmp_path / f"one{bad}.jsonl", lines)
        result = run_tool("preprocess_data.py", *args[:1], one, *args[2:3], str(tmp_path / f"strict{bad}"),
                          *args[4:], "--strict")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"one{bad}.jsonl:2: " in result.stderr
        assert not any(p.name.startswith(f"strict{bad}") for p in tmp_path.iterdir())


def test_a_repeated_json_key_is_refused(tmp_path):
    path = write_lines(tmp_path / "doc.jsonl", [HOSTILE_LINES[0]])
    result = run_tool("preprocess_data.py", "--input", path, "--output-prefix", str(tmp_path / "out"), "--json-keys",
                      "text", "text", "--tokenizer-type", "NullTokenizer", "--vocab-size", "20")
    assert result.returncode != 0 and "--json-keys text text: 'text' given more than once" in result.stderr
    assert "Traceback" not in result.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["doc.jsonl"]


def test_preprocess_never_writes_over_its_input(tmp_path):
    """Issue 38 item 13: an input whose name is one of the outputs (here JSON lines saved as x_text_document.bin)
    would have been truncated by the writer before it was read."""
    path = write_lines(tmp_path / "x_text_document.bin", [HOSTILE_LINES[0]])
    before = Path(path).read_bytes()
    result = run_tool("preprocess_data.py", "--input", path, "--output-prefix", str(tmp_path / "x"), "--tokenizer-type",
                      "NullTokenizer", "--vocab-size", "20")
    assert result.returncode != 0 and "which is --input; choose another prefix" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and Path(path).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_text_document.bin"]
