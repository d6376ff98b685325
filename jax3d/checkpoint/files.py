"""What a complete checkpoint step records about its own files, and the check a reader makes with it before
it reads any array: each file's size (`jax3d_files.json`, written by process 0) and its CRC32 (`jax3d_crc32.<p>.json`,
process p's share of the files, written in a background thread once the save is on disk). A copy cut short or a
flipped bit is then named in one sentence instead of restoring and training at NaN.

Both records sit at the top of the step's folder and are never part of what they list. A step saved before the
records existed, or whose checksums were not written (the run stopped first), is checked as far as it can be.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import zlib

from jax3d.config import ConfigError

FILE_LIST = "jax3d_files.json"  # relative path -> bytes
_CHECKSUMS = "jax3d_crc32.{}.json"  # one per saving process: relative path -> CRC32, 8 hex digits
_RECORDS = "jax3d_"  # what names a record, so that no record lists another
_CHUNK = 16 << 20


def _root(directory: str, step: int) -> str:
    return os.path.join(os.path.abspath(directory), str(step))


def _step_files(root: str) -> list[str]:
    """The files of a step's folder, relative to it and sorted, records left out."""
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if not (folder == root and name.startswith(_RECORDS)):
                out.append(rel)
    return sorted(out)


def _write_json(path: str, obj) -> None:
    """Whole or not at all: a record half-written by a killed process is never read."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def crc32(path: str) -> int:
    """The CRC32 of a file's bytes; zlib releases the GIL, so files hash in parallel and beside training."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record_files(directory: str, step: int) -> int:
    """Writes the file list of a complete step (relative path -> bytes) into it; returns the total bytes."""
    root = _root(directory, step)
    sizes = {rel: os.path.getsize(os.path.join(root, rel)) for rel in _step_files(root)}
    _write_json(os.path.join(root, FILE_LIST), sizes)
    return sum(sizes.values())


def record_checksums(directory: str, step: int, process: int = 0, processes: int = 1) -> None:
    """Writes the CRC32 of process `process`'s share (every `processes`-th file, in sorted order) of a complete
    step's files. Each process of a multi-process save hashes its share, so none reads the whole checkpoint."""
    root = _root(directory, step)
    share = _step_files(root)[process::processes]
    sums = {rel: f"{crc32(os.path.join(root, rel)):08x}" for rel in share}
    _write_json(os.path.join(root, _CHECKSUMS.format(process)), sums)


def _saved_checksums(root: str) -> dict:
    sums = {}
    for name in sorted(os.listdir(root)):
        if name.startswith(_CHECKSUMS.split("{")[0]) and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as f:
                    sums.update(json.load(f))
            except (OSError, ValueError):
                continue  # a record that can't be read checks nothing; the sizes still do
    return sums


def check_files(directory: str, step: int, contents: bool = True, items: tuple[str, ...] = ()) -> None:
    """ConfigError naming the first file of checkpoint step `step` that is missing, not the size it was saved
    with (a copy cut short, a disk that filled up) or, with `contents`, not the bytes it was saved with (its
    CRC32 differs): before anything is restored or compiled. `items` ("params", ...) limits the reading of
    bytes to the folders of the orbax items a reader restores. Steps saved before these records pass unchecked."""
    root = _root(directory, step)
    where = f"checkpoint {directory} step {step} is damaged"
    fix = "copy the checkpoint again, or pass another --ckpt-step or --load"
    try:
        with open(os.path.join(root, FILE_LIST)) as f:
            sizes = json.load(f)
    except (OSError, ValueError):
        sizes = {}
    for rel, want in sizes.items():
        path = os.path.join(root, rel)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have != want:
            what = "is missing" if have is None else f"holds {have:,} bytes where {want:,} were saved"
            raise ConfigError(f"{where}: {os.path.join(str(step), rel)} {what}; {fix}")
    sums = _saved_checksums(root) if contents and os.path.isdir(root) else {}
    if not sums:
        return
    rels = sorted(r for r in sums if not items or "/" not in r or r.split("/")[0] in items)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        have = dict(zip(rels, pool.map(lambda rel: _crc_or_none(os.path.join(root, rel)), rels)))
    for rel in rels:
        if have[rel] is None:
            raise ConfigError(f"{where}: {os.path.join(str(step), rel)} is missing; {fix}")
        if f"{have[rel]:08x}" != sums[rel]:
            raise ConfigError(f"{where}: {os.path.join(str(step), rel)} does not hold the bytes that were saved "
                              f"(CRC32 {have[rel]:08x}, saved as {sums[rel]}); {fix}")


def _crc_or_none(path: str) -> int | None:
    try:
        return crc32(path)
    except FileNotFoundError:
        return None
