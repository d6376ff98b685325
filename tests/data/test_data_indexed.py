"""The .bin/.idx reader and writer against Megatron's documented byte layout."""
import struct

import numpy as np
import pytest

from jax3d.data.indexed import DataError, IndexedDataset, IndexedDatasetBuilder, merge_datasets

DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12, 13]], [[1], [2, 3], [65000]]]  # documents of sequences


def _write(prefix, dtype=np.uint16, docs=DOCS):
    b = IndexedDatasetBuilder(str(prefix), dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize()
    return str(prefix)


def _parse_idx(path):
    """Independent parse of the documented layout with `struct`."""
    raw = open(path, "rb").read()
    magic = raw[:9]
    version, = struct.unpack_from("<Q", raw, 9)
    code, = struct.unpack_from("<B", raw, 17)
    n, d = struct.unpack_from("<QQ", raw, 18)
    off = 34
    sizes = struct.unpack_from(f"<{n}i", raw, off); off += 4 * n
    pointers = struct.unpack_from(f"<{n}q", raw, off); off += 8 * n
    doc_idx = struct.unpack_from(f"<{d}q", raw, off); off += 8 * d
    assert off == len(raw)
    return magic, version, code, list(sizes), list(pointers), list(doc_idx)


def test_layout_matches_megatron_field_for_field(tmp_path):
    prefix = _write(tmp_path / "a")
    magic, version, code, sizes, pointers, doc_idx = _parse_idx(prefix + ".idx")
    seqs = [s for doc in DOCS for s in doc]
    assert magic == b"MMIDIDX\x00\x00" and version == 1 and code == 8  # uint16
    assert sizes == [len(s) for s in seqs]
    assert pointers == list(np.cumsum([0] + [2 * len(s) for s in seqs[:-1]]))
    assert doc_idx == [0, 2, 3, 6]
    flat = [t for s in seqs for t in s]
    assert open(prefix + ".bin", "rb").read() == struct.pack(f"<{len(flat)}H", *flat)


@pytest.mark.parametrize("dtype,code", [(np.int32, 4), (np.uint16, 8), (np.int64, 5)])
def test_round_trip(tmp_path, dtype, code):
    ds = IndexedDataset(_write(tmp_path / "a", dtype))
    seqs = [s for doc in DOCS for s in doc]
    assert len(ds) == len(seqs) and ds.dtype == np.dtype(dtype)
    assert _parse_idx(str(tmp_path / "a.idx"))[2] == code
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds.get(2, 1, 3), [10, 11, 12])
    np.testing.assert_array_equal(ds.doc_idx, [0, 2, 3, 6])
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in seqs])
    assert isinstance(ds.tokens, np.memmap)


def test_merge_equals_single_builder(tmp_path):
    parts = [_write(tmp_path / f"p{i}", docs=[doc]) for i, doc in enumerate(DOCS)]
    merge_datasets(str(tmp_path / "m"), parts)
    _write(tmp_path / "whole")
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"m{ext}", "rb").read() == open(tmp_path / f"whole{ext}", "rb").read()


def _corrupt(path, fn):
    raw = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(fn(raw)))


def _set(raw, off, val):
    raw[off:off + len(val)] = val
    return raw


@pytest.mark.parametrize("what,fn,words", [
    ("truncated idx", lambda r: r[:-5], "truncated"),
    ("short header", lambda r: r[:20], "truncated"),
    ("bad magic", lambda r: _set(r, 0, b"NOTANIDX\x00"), "magic"),
    ("bad version", lambda r: _set(r, 9, struct.pack("<Q", 2)), "version 2"),
    ("bad dtype code", lambda r: _set(r, 17, bytes([9])), "dtype code 9"),
])
def test_corrupt_index_raises_clear_error(tmp_path, what, fn, words):
    prefix = _write(tmp_path / "a")
    _corrupt(prefix + ".idx", fn)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert prefix + ".idx" in msg and words in msg and "rebuild" in msg
    assert msg.count(". ") == 0 and "\n" not in msg  # one sentence


def test_truncated_bin_and_missing_files(tmp_path):
    prefix = _write(tmp_path / "a")
    _corrupt(prefix + ".bin", lambda r: r[:-2])
    with pytest.raises(DataError, match=r"a\.bin is .* truncated"):
        IndexedDataset(prefix)
    with pytest.raises(DataError, match=r"nope\.idx does not exist"):
        IndexedDataset(str(tmp_path / "nope"))
    with pytest.raises(DataError, match=r"a\.bin names a file, .* pass .*a\.$"):
        IndexedDataset(prefix + ".bin")
    assert issubclass(DataError, ValueError)
