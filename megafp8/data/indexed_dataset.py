"""Megatron-compatible indexed dataset: ``PREFIX.bin`` holds raw tokens, ``PREFIX.idx`` says where each sequence is.

The byte layout is Megatron-LM's ``MMIDIDX`` version 1 (``megatron/core/datasets/indexed_dataset.py``), so
files written here are read by Megatron and vice versa:

    .idx  magic b"MMIDIDX\\x00\\x00" | version <Q (=1) | dtype code <B | sequence count S <Q |
          document count + 1 (=D) <Q | S x int32 sequence lengths | S x int64 byte pointers into .bin |
          D x int64 document indices (sequence index where each document starts; first 0, last S)
    .bin  the tokens of every sequence back to back, in the dtype named by the code (uint16 or int32)

The reader validates the whole layout when it opens a dataset, so a truncated or corrupt file fails there
with a message naming the file, not later as an out-of-range read in a data-loader worker.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Iterable, Sequence

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document-index count; "<" means packed, so 34 bytes.
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's DType enum: the code written in the header for each numpy dtype.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated or inconsistent; the message names the file and the problem."""


def idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Token dtype for a vocabulary: uint16 below 65500 entries (Megatron's threshold), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dataset_exists(path_prefix: str) -> bool:
    return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))


def _read_index(path: str, validate: bool) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Map the arrays of an .idx file after checking that its header and size agree."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"{path}: index file not found")
    file_size = os.path.getsize(path)
    if file_size < _HEADER.size:
        raise IndexedDatasetError(
            f"{path}: truncated index: {file_size} bytes, shorter than the {_HEADER.size}-byte header"
        )
    with open(path, "rb") as f:
        magic, version, code, seq_count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
    if magic != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{path}: bad magic {magic!r} (expected {INDEX_MAGIC!r}); not a Megatron MMIDIDX index"
        )
    if version != INDEX_VERSION:
        raise IndexedDatasetError(f"{path}: unsupported index version {version} (only version 1 is known)")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    expected = _HEADER.size + seq_count * (4 + 8) + doc_count * 8
    # Megatron's multimodal datasets append one int8 mode per sequence; the arrays we read come first.
    if file_size not in (expected, expected + seq_count):
        raise IndexedDatasetError(
            f"{path}: sizes don't add up: the header declares {seq_count} sequences and {doc_count} "
            f"document indices, which need {expected} bytes, but the file has {file_size} bytes "
            "(truncated, or written by an interrupted job?)"
        )
    if doc_count < 1:
        raise IndexedDatasetError(f"{path}: corrupt index: the document-index array is empty (needs at least [0])")

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    offset = _HEADER.size
    lengths = np.frombuffer(buffer, dtype="<i4", count=seq_count, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(buffer, dtype="<i8", count=seq_count, offset=offset)
    offset += pointers.nbytes
    document_indices = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=offset)

    if document_indices[0] != 0 or document_indices[-1] != seq_count:
        raise IndexedDatasetError(
            f"{path}: corrupt document indices: they must run from 0 to the sequence count {seq_count}, "
            f"got {int(document_indices[0])} .. {int(document_indices[-1])}"
        )
    if validate and seq_count:
        # O(S) checks, vectorized: milliseconds for millions of sequences and they catch bit rot early.
        if lengths.min() < 0:
            raise IndexedDatasetError(f"{path}: corrupt index: negative sequence length")
        if np.any(np.diff(document_indices) < 0):
            raise IndexedDatasetError(f"{path}: corrupt index: document indices are not non-decreasing")
        itemsize = DTYPE_CODES[code].itemsize
        expected_pointers = np.zeros(seq_count, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected_pointers[1:])
        expected_pointers *= itemsize
        if not np.array_equal(pointers, expected_pointers):
            first = int(np.argmax(pointers != expected_pointers))
            raise IndexedDatasetError(
                f"{path}: corrupt index: byte pointer of sequence {first} is {int(pointers[first])}, "
                f"but the lengths before it put it at {int(expected_pointers[first])}"
            )
    return DTYPE_CODES[code], lengths, pointers, document_indices


class _MMapBinReader:
    """Tokens of a .bin through one read-only memory map (the default: pages shared by every reader)."""

    def __init__(self, path: str, dtype: np.dtype, num_tokens: int) -> None:
        # np.memmap refuses empty files; an empty dataset is legal (e.g. a job whose input was all bad).
        self._tokens = np.memmap(path, dtype=dtype, mode="r") if num_tokens else np.empty(0, dtype=dtype)

    def read(self, start: int, count: int) -> np.ndarray:
        return self._tokens[start : start + count]


class _FileBinReader:
    """Tokens of a .bin by positioned file reads (Megatron's ``--no-mmap-bin-files``): for file systems where
    mapping a large file is slow or unsupported. ``os.pread`` keeps no file position, so one descriptor serves
    every caller, threads and forked data-loader workers included."""

    def __init__(self, path: str, dtype: np.dtype, num_tokens: int) -> None:
        self._dtype = dtype
        self._num_tokens = num_tokens
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, start: int, count: int) -> np.ndarray:
        # Clipped at the end of the file, as slicing the memory map is: the two readers return the same arrays.
        tokens = np.empty(max(min(count, self._num_tokens - start), 0), dtype=self._dtype)
        view = memoryview(tokens).cast("B")
        offset, done = start * self._dtype.itemsize, 0
        while done < len(view):  # pread may return less than asked (very large reads); EOF cannot happen here
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise IndexedDatasetError(f"short read at byte {offset + done} of a .bin file (truncated while open?)")
            done += n
        return tokens

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx``; ``ds[i]`` is sequence ``i`` as numpy.

    The .idx is memory-mapped; the .bin too unless ``mmap=False`` (Megatron's ``--no-mmap-bin-files``), which
    reads it with file reads instead: the same tokens either way. Opening checks the header, that the index
    size matches its declared counts, that the pointers follow from the lengths (skippable with
    ``validate=False`` for huge indices) and that the .bin size matches.
    """

    def __init__(self, path_prefix: str, validate: bool = True, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.mmap = mmap
        self._validate = validate
        self._open()

    def _open(self) -> None:
        index = idx_path(self.path_prefix)
        data = bin_path(self.path_prefix)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_index(
            index, self._validate
        )
        if not os.path.isfile(data):
            raise IndexedDatasetError(f"{data}: data file not found (its index {index} exists)")
        bin_size = os.path.getsize(data)
        seq_count = len(self.sequence_lengths)
        needed = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if seq_count
            else 0
        )
        if bin_size != needed:
            raise IndexedDatasetError(
                f"{data}: sizes don't add up: {bin_size} bytes, but {index} describes {needed} bytes "
                f"({seq_count} sequences of {self.dtype.name}); truncated, or a .bin from another run?"
            )
        self._bin_tokens = bin_size // self.dtype.itemsize
        self._bin = (_MMapBinReader if self.mmap else _FileBinReader)(data, self.dtype, self._bin_tokens)

    # Data-loader workers receive the dataset by pickle: send the path, not the mapped pages.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "mmap": self.mmap, "_validate": False}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"mmap": True, **state})
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def token_id_range(self, chunk: int = 1 << 24) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin, read in chunks (bounded memory); (0, -1) when empty."""
        low, high = 0, -1
        for start in range(0, self._bin_tokens, chunk):
            block = self._bin.read(start, min(chunk, self._bin_tokens - start))
            low, high = (int(block.min()), int(block.max())) if high < 0 else (
                min(low, int(block.min())), max(high, int(block.max())))
        return low, high

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (a view into the mapped file, or a copy read
        from it without the map)."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin.read(start, length)


class IndexedDatasetWriter:
    """Streams sequences to ``PREFIX.bin.tmp``; :meth:`finalize` writes the index and renames both into place.

    Until ``finalize`` returns nothing exists under the final names, so an interrupted job never leaves a
    half dataset that a reader could mistake for a complete one. Used as a context manager, an exception
    removes the temporary files.
    """

    def __init__(self, path_prefix: str, dtype: np.dtype | type) -> None:
        self.path_prefix = path_prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"{path_prefix}: dtype {self.dtype} has no Megatron dtype code")
        self._code = _CODE_OF_DTYPE[self.dtype]
        self._disk_dtype = self.dtype.newbyteorder("<")  # the format is little-endian on every host
        parent = os.path.dirname(os.path.abspath(path_prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin_tmp = bin_path(path_prefix) + ".tmp"
        self._idx_tmp = idx_path(path_prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        # Kept as chunks and joined once in finalize: appending per document to numpy would be quadratic.
        self._length_chunks: list[np.ndarray] = []
        self._document_end_chunks: list[np.ndarray] = []
        self.sequence_count = 0
        self.num_tokens = 0

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document made of one sequence."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size], dtype=np.int32))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents: ``tokens`` concatenated, ``lengths[i]`` tokens each."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self._disk_dtype).data)
        self._length_chunks.append(lengths)
        self._document_end_chunks.append(self.sequence_count + np.arange(1, len(lengths) + 1, dtype=np.int64))
        self.sequence_count += len(lengths)
        self.num_tokens += tokens.size

    def add_index(self, source: IndexedDataset, progress: bool = False) -> None:
        """Append a whole dataset (its sequences and document boundaries) by streaming its .bin."""
        if source.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{idx_path(source.path_prefix)}: token dtype {source.dtype.name} differs from the "
                f"output's {self.dtype.name}; datasets must share a tokenizer to be merged"
            )
        self._length_chunks.append(np.array(source.sequence_lengths, dtype=np.int32))
        self._document_end_chunks.append(self.sequence_count + np.asarray(source.document_indices[1:]))
        self.sequence_count += len(source)
        self.num_tokens += source.num_tokens
        with open(bin_path(source.path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)

    def finalize(self) -> None:
        """Write the index, flush both files to disk, then rename them to their final names."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._length_chunks) if self._length_chunks else np.zeros(0, np.int32)
        ends = np.concatenate(self._document_end_chunks) if self._document_end_chunks else np.zeros(0, np.int64)
        write_index(self._idx_tmp, self._code, lengths, np.concatenate([[0], ends]).astype(np.int64))
        # Remove the old index first: a crash between the two renames then leaves a .bin without an .idx
        # (reported as missing) rather than a new .bin paired with a stale .idx.
        final_idx, final_bin = idx_path(self.path_prefix), bin_path(self.path_prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self._bin_tmp, final_bin)
        os.replace(self._idx_tmp, final_idx)

    def abort(self) -> None:
        """Close and delete the temporary files (nothing was ever written under the final names)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_index(path: str, dtype_code: int, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an MMIDIDX v1 index; byte pointers follow from the lengths and the dtype's size."""
    itemsize = DTYPE_CODES[dtype_code].itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths):
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    with open(path, "wb") as f:
        f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code, len(lengths), len(document_indices)))
        f.write(np.ascontiguousarray(lengths, dtype="<i4").data)
        f.write(pointers.data)
        f.write(np.ascontiguousarray(document_indices, dtype="<i8").data)
        f.flush()
        os.fsync(f.fileno())


def merge_indexed_datasets(prefixes: Iterable[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets (e.g. written by several preprocessing jobs), in the given order."""
    sources = [IndexedDataset(p) for p in prefixes]
    if not sources:
        raise IndexedDatasetError(f"{output_prefix}: nothing to merge (no input datasets)")
    for src in sources[1:]:
        if src.dtype != sources[0].dtype:
            raise IndexedDatasetError(
                f"{idx_path(src.path_prefix)}: token dtype {src.dtype.name} differs from "
                f"{sources[0].dtype.name} in {idx_path(sources[0].path_prefix)}; were they tokenized alike?"
            )
    with IndexedDatasetWriter(output_prefix, sources[0].dtype) as writer:
        for src in sources:
            writer.add_index(src)
        writer.finalize()
    return IndexedDataset(output_prefix)
