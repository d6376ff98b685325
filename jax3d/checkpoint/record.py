"""What a checkpoint records of its run's data and tokenizer files, to know them again: fingerprints."""
from __future__ import annotations

import hashlib
import os

from jax3d.config import TOKENIZER_FILE_KEYS, DataConfig

_EDGE = 1 << 20  # bytes read at each end of an .idx for its fingerprint


def file_fingerprint(path: str, whole: bool = True) -> str:
    """sha256 of a file's size and bytes; with `whole` False, of its size and first and last MiB only (an .idx
    holds every document's size and offset, so its ends and length tell two corpora apart)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if whole or size <= 2 * _EDGE:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        else:
            h.update(f.read(_EDGE))
            f.seek(size - _EDGE)
            h.update(f.read(_EDGE))
    return h.hexdigest()[:24]


def idx_fingerprint(prefix: str) -> str | None:
    path = prefix + ".idx"
    return file_fingerprint(path, whole=False) if os.path.isfile(path) else None


def data_record(d: DataConfig) -> dict:
    """The checkpoint's record of a run's data: `--data-path` as given and absolute, each prefix's .idx
    fingerprint, the split and the sample-index cache; with separate datasets per split, each
    `--{train,valid,test}-data-path` the same way under "split_paths"."""
    out = {**paths_record(d.data_path), "split": d.split,
           "cache_dir": os.path.abspath(d.cache_dir) if d.cache_dir else ""}
    if d.split_paths:
        out["split_paths"] = {which: paths_record(p) for which, p in d.split_paths.items()}
    return out


def paths_record(data_path) -> dict:
    """One `--data-path` (or `--*-data-path`) as given, its prefixes absolute and their .idx fingerprints."""
    from jax3d.data.sampling import parse_data_paths

    prefixes = parse_data_paths(list(data_path))[1] if data_path else []
    return {"data_path": list(data_path), "prefixes": [os.path.abspath(p) for p in prefixes],
            "idx_fingerprints": [idx_fingerprint(p) for p in prefixes]}


def tokenizer_fingerprints(info: dict) -> dict:
    """{file key: fingerprint} of a tokenizer record's files that exist."""
    return {k: file_fingerprint(info[k]) for k in TOKENIZER_FILE_KEYS if info.get(k) and os.path.isfile(info[k])}
