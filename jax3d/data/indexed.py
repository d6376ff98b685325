"""Megatron's memory-mapped indexed dataset (`.bin` + `.idx`), byte compatible.

`.idx` layout, little-endian:
  9-byte magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code,
  u64 N (sequences), u64 D (doc-index entries),
  N int32 sizes, N int64 byte offsets into `.bin`, D int64 doc_idx.
`.bin` is the raw token array, sequences back to back.
"""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D

DTYPES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class DataError(ValueError):
    """A data file is missing, malformed, or does not match what was asked for."""


def best_dtype(vocab_size: int) -> type:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_path(prefix: str) -> str:
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.exists(index_path(prefix)) and os.path.exists(data_path(prefix))


def write_index(path: str, dtype, sizes, doc_idx) -> None:
    """Write a `.idx` file for sequences of `sizes` tokens of `dtype`, documents ending at `doc_idx`."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        # Byte offset of each sequence is the running sum of the previous ones' bytes.
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, _CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams token sequences into `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`.

    A sequence is one `add_item` (a document, or one sentence of a sentence-split document);
    `end_document()` closes the current document.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise DataError(f"Token dtype {self.dtype} has no Megatron code; use one of "
                            f"{sorted(str(np.dtype(d)) for d in DTYPES.values())}.")
        self._bin = open(data_path(prefix), "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence of token ids."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def add_chunk(self, tokens, sizes, seqs_per_doc) -> None:
        """Append many whole documents at once: flat `tokens`, each sequence's size, and how many
        sequences each document has (equivalent to add_item/end_document calls, but one write)."""
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        base = len(self._sizes)
        self._sizes.extend(np.asarray(sizes).tolist())
        self._doc_idx.extend((base + np.cumsum(seqs_per_doc)).tolist())

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._sizes))

    def add_index(self, other_prefix: str) -> None:
        """Append a finished dataset (e.g. one worker's output) to this one, token dtypes must match."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{index_path(other_prefix)} holds {other.dtype} tokens but the builder "
                            f"writes {self.dtype}; rebuild it with the same dtype.")
        base = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((base + other.doc_idx[1:]).tolist())
        del other
        with open(data_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)

    def abort(self) -> None:
        """Close and delete the partial `.bin`; no `.idx` is written."""
        self._bin.close()
        if os.path.exists(data_path(self.prefix)):
            os.remove(data_path(self.prefix))

    def finalize(self) -> None:
        """Close `.bin` and write `.idx`."""
        self._bin.close()
        write_index(index_path(self.prefix), self.dtype, self._sizes, self._doc_idx)


def merge_datasets(out_prefix: str, prefixes: list[str], dtype=None) -> None:
    """Concatenate finished datasets, in order, into `out_prefix` (used to join worker outputs)."""
    if dtype is None:
        dtype = IndexedDataset(prefixes[0]).dtype if prefixes else np.int32
    builder = IndexedDatasetBuilder(out_prefix, dtype)
    for p in prefixes:
        builder.add_index(p)
    builder.finalize()


class IndexedDataset:
    """Read-only view of `<prefix>.bin/.idx`, memory-mapped; nothing is read until indexed."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_file = index_path(prefix)
        bin_file = data_path(prefix)
        for path in (idx_file, bin_file):
            if not os.path.exists(path):
                stem, ext = os.path.splitext(prefix)
                if ext in (".bin", ".idx") and os.path.exists(index_path(stem)):
                    raise DataError(f"{prefix} names a file, but a data path is the prefix before .bin/.idx; "
                                    f"pass {stem}.")
                raise DataError(f"{path} does not exist; run launch/preprocess_data.py to build it.")
        idx_bytes = os.path.getsize(idx_file)
        if idx_bytes < _HEADER.size:
            raise DataError(f"{idx_file} is truncated ({idx_bytes} bytes, header alone is "
                            f"{_HEADER.size}); rebuild it with launch/preprocess_data.py.")
        with open(idx_file, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            raise DataError(f"{idx_file} does not start with Megatron's magic {_MAGIC!r} (got "
                            f"{magic!r}); it is not an mmap .idx file, rebuild it with "
                            "launch/preprocess_data.py.")
        if version != _VERSION:
            raise DataError(f"{idx_file} has index version {version}, only version {_VERSION} is "
                            "supported; rebuild it with launch/preprocess_data.py.")
        if code not in DTYPES:
            raise DataError(f"{idx_file} has dtype code {code}, outside the table "
                            f"{sorted(DTYPES)}; the file is corrupt, rebuild it.")
        expected = _HEADER.size + n * 4 + n * 8 + d * 8
        if idx_bytes != expected:
            raise DataError(f"{idx_file} is {idx_bytes} bytes but its header ({n} sequences, {d} "
                            f"doc-index entries) needs {expected}; it is truncated or corrupt, "
                            "rebuild it.")
        self.dtype = np.dtype(DTYPES[code])
        self._idx_mm = np.memmap(idx_file, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sizes = np.frombuffer(self._idx_mm, np.int32, n, off)
        self.pointers = np.frombuffer(self._idx_mm, np.int64, n, off + 4 * n)
        self.doc_idx = np.frombuffer(self._idx_mm, np.int64, d, off + 12 * n)
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        bin_bytes = os.path.getsize(bin_file)
        if bin_bytes < need:
            raise DataError(f"{bin_file} is {bin_bytes} bytes but {idx_file} indexes {need}; the "
                            ".bin is truncated, rebuild both with launch/preprocess_data.py.")
        # np.memmap refuses empty files; an empty dataset simply has no tokens.
        self._bin = (np.memmap(bin_file, mode="r", dtype=self.dtype) if bin_bytes
                     else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset+length` of sequence `i` (a view into the mapped `.bin`)."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    @property
    def tokens(self) -> np.ndarray:
        """All tokens, back to back (a mapped view, not a copy)."""
        return self._bin

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1
