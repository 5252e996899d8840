"""megafp8's safetensors header reader (the converter's lazy, mmap-free reader) accepts exactly the files the
safetensors library accepts: a valid file, and each crafted header (negative or string offsets, two tensors on
one byte range, a gap, trailing bytes, a JSON list, a size that does not match the shape) judged by both."""
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megafp8.checkpoint.hf_files import ConversionError, _read_header


def _write(path, header, data: bytes) -> None:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _valid(tmp_path):
    path = tmp_path / "valid.safetensors"
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _mutations(header, data):
    a, b = header["a"], header["b"]
    yield "valid", header, data
    yield "negative offset", {**header, "a": {**a, "data_offsets": [-256, 0]}}, data
    yield "string offsets", {**header, "a": {**a, "data_offsets": ["0", "16"]}}, data
    yield "shared range", {**header, "b": {**b, "data_offsets": a["data_offsets"], "dtype": "F32", "shape": [4]}}, data
    yield "gap", {**header, "b": {**b, "data_offsets": [b["data_offsets"][0] + 2, b["data_offsets"][1] + 2]}}, data + b"xx"
    yield "trailing bytes", header, data + b"\0" * 8
    yield "truncated", header, data[:-1]
    yield "shape mismatch", {**header, "a": {**a, "shape": [5]}}, data
    yield "unknown dtype", {**header, "a": {**a, "dtype": "Q7"}}, data
    yield "negative dim", {**header, "a": {**a, "shape": [-4]}}, data
    yield "list header", b"[1, 2]", data
    yield "metadata not strings", {**header, "__metadata__": {"format": 1}}, data


def _library_accepts(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                f.get_slice(key).get_shape()
        return True
    except Exception:
        return False


def _ours_accepts(path) -> bool:
    try:
        _read_header(path)
        return True
    except ConversionError:
        return False


def test_reader_accepts_exactly_what_the_safetensors_library_accepts(tmp_path):
    header, data = _valid(tmp_path)
    verdicts = {}
    for name, mutated, payload in _mutations(header, data):
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        _write(path, mutated, payload)
        verdicts[name] = (_library_accepts(path), _ours_accepts(path))
    assert verdicts["valid"] == (True, True)
    assert all(library == ours for library, ours in verdicts.values()), verdicts
    assert sum(library for library, _ in verdicts.values()) == 1, "every crafted header is a rejection"


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path, name):
    from megafp8.checkpoint.hf_files import HfTensors

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ConversionError, match="the shards must be files in"):
        HfTensors(tmp_path)
