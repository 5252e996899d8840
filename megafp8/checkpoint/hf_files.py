"""Hugging Face Llama (and Qwen3, Mixtral, Qwen3-MoE) directories on disk: config.json validation, a lazy reader of
(sharded) safetensors, a streaming writer that shards past a size, and the temporary-directory-then-rename commit
conversions use."""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megafp8.checkpoint.atomic import fsync_path, save_dir_error
from megafp8.checkpoint.errors import CheckpointError
from megafp8.model.config import ModelConfig
from megafp8.model.hf_mapping import hf_rope_problems, model_config_from_hf
from megafp8.model.hf_moe_mapping import FAMILIES as MOE_FAMILIES, hf_moe_problems, moe_fields_from_hf

INDEX_FILE = "model.safetensors.index.json"
# config.json fields whose non-default value changes the math in a way megafp8's Llama does not implement.
_UNSUPPORTED = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None),
                "sliding_window": (None,)}
_LLAMA_DEFAULTS = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.02,
                       max_position_embeddings=2048)


class ConversionError(CheckpointError):
    """A conversion input (file, config field, flag) megafp8 cannot convert; the message names it."""


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing: --load-dir must be a Hugging Face model directory") from None
    except ValueError as e:
        raise ConversionError(f"{path} is not valid JSON ({e})") from None


_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _invalid_sizes(config: Mapping[str, Any]) -> list[str]:
    """Fields whose value no Llama has (a missing, zero or non-integer size; a non-positive epsilon or theta)."""
    def positive_int(value) -> bool:
        return type(value) is int and value > 0

    def positive_float(value) -> bool:
        return type(value) in (int, float) and math.isfinite(value) and value > 0

    problems = [f"{key} {config.get(key)!r} must be a positive integer" for key in _POSITIVE_INTS
                if not positive_int(config.get(key))]
    for key, default, check, what in (("num_key_value_heads", config.get("num_attention_heads"), positive_int,
                                       "a positive integer"),
                                      ("max_position_embeddings", 2048, positive_int, "a positive integer"),
                                      ("rms_norm_eps", 1e-6, positive_float, "a positive number"),
                                      ("rope_theta", 10000.0, positive_float, "a positive number")):
        value = config.get(key, default)
        if value is not None and not check(value) and not (key == "num_key_value_heads" and problems):
            problems.append(f"{key} {value!r} must be {what}")
    return problems


def model_config_from_hf_dict(config: Mapping[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of a Llama (or dense Qwen3: --qk-layernorm; or Mixtral / Qwen3-MoE: --num-experts) config.json;
    any architecture megafp8 cannot reproduce is a ConversionError."""
    if config.get("model_type") not in ("llama", "qwen3", *MOE_FAMILIES):
        raise ConversionError(f"{source}: model_type {config.get('model_type')!r} is not supported "
                              "(megafp8 converts Llama checkpoints, model_type 'llama', dense Qwen3 ones, 'qwen3', and "
                              "the MoE families Mixtral, 'mixtral', and Qwen3-MoE, 'qwen3_moe')")
    invalid = _invalid_sizes(config)
    if invalid:
        raise ConversionError(f"{source}: {'; '.join(invalid)}")
    unsupported = dict(_UNSUPPORTED)
    if config["model_type"] in ("qwen3", "qwen3_moe"):  # Qwen3 reads sliding_window only under use_sliding_window
        unsupported.update(use_sliding_window=(False, None))
        if not config.get("use_sliding_window"):
            del unsupported["sliding_window"]
    problems = [f"{key}={config[key]!r}" for key, allowed in unsupported.items()
                if key in config and config[key] not in allowed]
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))!r}")
    heads = config.get("num_attention_heads")
    fields = SimpleNamespace(**{**_LLAMA_DEFAULTS, "num_key_value_heads": heads, **config})
    try:
        problems += hf_rope_problems(fields)
    except (TypeError, ValueError) as e:  # e.g. a factor that is not a number
        problems.append(f"rope_scaling/rope_parameters ({type(e).__name__}: {e})")
    moe = config["model_type"] in MOE_FAMILIES
    problems += hf_moe_problems(config) if moe else []
    if problems:
        raise ConversionError(f"{source}: unsupported config field(s) {', '.join(problems)}: megafp8's Llama has "
                              "SiLU-gated MLPs, no biases, full attention and RoPE unscaled or with Llama-3.1's "
                              "frequency scaling (rope_type 'llama3')")
    try:
        return model_config_from_hf(fields, **(moe_fields_from_hf(config) if moe else {}))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{source}: cannot read the architecture ({type(e).__name__}: {e})") from None


def use_mmap_for_large_allocations(threshold: int = 1 << 20) -> None:
    """Make glibc serve every allocation over ``threshold`` bytes by mmap (returned to the OS on free).

    Its default threshold grows with each large free (up to 32 MiB), after which the converter's
    per-tensor buffers come from the heap and fragment it: peak RSS then grows with the model although
    only one tensor is alive at a time (measured: 224 MiB vs 18 MiB for a 107M-parameter model). A no-op
    where the C library has no mallopt."""
    try:
        ctypes.CDLL(None).mallopt(-3, threshold)  # M_MMAP_THRESHOLD; a fixed value disables the growth
    except (AttributeError, OSError):
        pass


class HfTensors:
    """Every tensor of a Hugging Face directory by name, read one at a time from its safetensors file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError("weight_map must map tensor names to file names")
            except (ValueError, KeyError, TypeError) as e:
                raise ConversionError(f"{index} is corrupt ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
            # A file name, not a path: nothing outside --load-dir is read ('/etc/x', '../x', 'a/../../x').
            outside = [f for f in files if Path(f).name != f or f in (".", "..")]
            if outside:
                raise ConversionError(f"{index} names {outside[0]!r}: the shards must be files in {directory}")
        else:
            files, weight_map = sorted(p.name for p in directory.glob("*.safetensors")), None
            if not files:
                raise ConversionError(f"{directory} has no *.safetensors files (PyTorch .bin checkpoints: "
                                      "re-save them with save_pretrained(safe_serialization=True))")
        self.location: dict[str, str] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._data_start: dict[str, int] = {}
        for name in files:
            header, self._data_start[name] = _read_header(directory / name)
            for key, entry in header.items():
                if key != "__metadata__" and (weight_map is None or weight_map.get(key) == name):
                    self.location[key] = name
                    self._entries[key] = entry

    def _entry(self, name: str, needed_by: str) -> dict[str, Any]:
        if name not in self.location:
            raise ConversionError(f"{self.directory}: tensor {name!r} is missing (needed for {needed_by})")
        return self._entries[name]

    def shape(self, name: str, needed_by: str = "the model") -> tuple[int, ...]:
        return tuple(self._entry(name, needed_by)["shape"])

    def get(self, name: str, needed_by: str = "the model") -> torch.Tensor:
        """The tensor, read with plain file reads (no mmap: its pages would count as this process's memory)."""
        entry, file = self._entry(name, needed_by), self.location[name]
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConversionError(f"{self.directory / file}: {name!r} has dtype {entry['dtype']}, not a float type")
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        buffer = bytearray(end - begin)
        with open(self.directory / file, "rb") as f:
            f.seek(self._data_start[file] + begin)
            if f.readinto(buffer) != len(buffer):
                raise ConversionError(f"{self.directory / file} is truncated: {name!r} ends past the end of the file")
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry["shape"])


# Bytes per element of every dtype the safetensors format names (the library's list), for its size checks.
_SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the library's limit


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset its data starts at, accepted exactly when the safetensors library
    accepts the file (its rules: a JSON object under 100 MB; per tensor a known dtype, a shape of non-negative
    integers and integer offsets; the tensors' byte ranges tile the data with no gap or overlap, each as long as its
    shape and dtype say, and end at the end of the file)."""
    if not path.exists():
        raise ConversionError(f"{path} is missing (listed in {INDEX_FILE})")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES or length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            text = f.read(length)
        if not text.startswith(b"{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text)
        end = _validate_entries(header)
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConversionError(f"{path} is truncated or not a safetensors file ({e})") from None
    if 8 + length + end != size:
        raise ConversionError(f"{path} is truncated or has trailing bytes: its header lists {8 + length + end} bytes, "
                              f"the file has {size}")
    return header, 8 + length


def _validate_entries(header: Any) -> int:
    """The data's length if every entry is well formed and the byte ranges tile [0, length); else ValueError."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must map names to strings")
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_ITEMSIZE:
            raise ValueError(f"{name!r}: not a tensor entry with a known dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{name!r}: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
            raise ValueError(f"{name!r}: data_offsets {offsets!r} is not two non-negative integers")
        ranges.append((offsets[0], offsets[1], math.prod(shape) * _SAFETENSORS_ITEMSIZE[entry["dtype"]], name))
    position = 0
    for begin, end, nbytes, name in sorted(ranges):
        if begin != position or end < begin:
            raise ValueError(f"{name!r}: data_offsets [{begin}, {end}] overlap another tensor or leave a gap")
        if end - begin != nbytes:
            raise ValueError(f"{name!r}: {end - begin} bytes for a tensor of {nbytes}")
        position = end
    return position


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float8_e4m3fn: "F8_E4M3", torch.float64: "F64", torch.uint8: "U8"}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


class ShardedSafetensorsWriter:
    """Streams tensors straight into ``model-XXXXX-of-YYYYY.safetensors`` files of at most ``max_shard_bytes``
    (one ``model.safetensors`` when everything fits) plus the index Hugging Face loaders read. Every name,
    shape and dtype is known up front, so each file's header is written first and a tensor's bytes go to
    disk as soon as it arrives: memory holds one tensor, not one shard."""

    def __init__(self, directory: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int) -> None:
        self.directory, self.entries = directory, entries
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dtype))
            size += nbytes
        count = len(shards)
        self.names = ["model.safetensors"] if count == 1 else \
            [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.shards = shards
        self.file_of = {name: i for i, shard in enumerate(shards) for name, _, _ in shard}
        self.total_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
        self._next = 0  # index into entries
        self._file = None
        self._shard = -1

    def _open(self, shard: int) -> None:
        if self._file is not None:
            self._file.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in self.shards[shard]:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors itself writes it
        self._file = open(self.directory / self.names[shard], "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._shard = shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected, shape, dtype = self.entries[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected, shape, dtype):
            raise ValueError(f"safetensors writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned "
                             f"{expected} {shape} {dtype}")
        if self.file_of[name] != self._shard:
            self._open(self.file_of[name])
        self._file.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        self._next += 1

    def finish(self) -> list[str]:
        """Close the last file and write the index (when sharded); returns the file names."""
        if self._next != len(self.entries):
            raise ValueError(f"safetensors writer: {len(self.entries) - self._next} planned tensors never came")
        if self._file is not None:
            self._file.close()
        if len(self.names) > 1:
            weight_map = {name: self.names[i] for name, i in self.file_of.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return self.names


@contextlib.contextmanager
def atomic_output_dir(target: Path, flag: str) -> Iterator[Path]:
    """A temporary sibling directory that becomes ``target`` by one rename when the body succeeds; on any
    error it is removed, so nothing appears under ``target``. ``target`` must not exist (or be empty)."""
    if target.is_symlink():  # the final rename would replace the link, not fill the directory it points to
        raise ConversionError(f"{flag} {target} is a symbolic link; give the directory itself")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConversionError(f"{flag} {target} already exists and is not empty; choose a new directory")
    problem = save_dir_error(target, flag)
    if problem:
        raise ConversionError(problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_path(path)
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
        fsync_path(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
