"""Pieces shared by the GPT and BERT datasets: `--data-path` and `--split` parsing, the
index cache, and Megatron's weighted blending."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

from jax3d.data.indexed import DataError, IndexedDataset
from jax3d.file_util import readable_by_all

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_paths(data_paths) -> tuple[list[float], list[str]]:
    """Megatron's `--data-path`: one bare prefix, or `w1 prefix1 w2 prefix2 ...`.

    Returns (weights normalised to sum 1, prefixes). A single string is split on whitespace.
    """
    if isinstance(data_paths, str):
        data_paths = data_paths.split()
    data_paths = [str(p) for p in data_paths]
    if len(data_paths) == 1:
        return [1.0], data_paths
    if not data_paths or len(data_paths) % 2:
        raise DataError(f"--data-path {' '.join(data_paths)} must be one prefix or pairs of "
                        "weight and prefix, like '0.3 dataA 0.7 dataB'.")
    try:
        weights = [float(w) for w in data_paths[0::2]]
    except ValueError:
        raise DataError(f"--data-path {' '.join(data_paths)} must alternate weight and prefix, "
                        "like '0.3 dataA 0.7 dataB'.") from None
    if not all(np.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--data-path weights {weights} must be finite, non-negative numbers with a positive sum.")
    total = sum(weights)
    return [w / total for w in weights], data_paths[1::2]


def split_ranges(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Megatron's `--split 969,30,1`: contiguous document ranges for train/valid/test.

    Weights are normalised; rounding error is taken from the later splits so the last ends at
    `num_docs`.
    """
    parts = split_weights(split)
    total = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / total * num_docs)))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(max(bounds[i], 0), bounds[i + 1]) for i in range(3)]


def split_weights(split: str) -> list[float]:
    """The three weights (train, valid, test) of Megatron's `--split 969,30,1`; DataError when malformed."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise DataError(f"--split {split} must be comma-separated weights like 969,30,1.") from None
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"--split {split} must be up to three non-negative weights with a positive "
                        "sum, like 969,30,1.")
    return parts + [0.0] * (3 - len(parts))


def split_units(indexed: IndexedDataset, by_sequence: bool) -> int:
    """How many units `--split` divides: sequences for GPT, whose sample windows walk the sequences (in
    sentence-split data each sentence is a document, as in Megatron's GPT dataset), documents for BERT."""
    return len(indexed) if by_sequence else indexed.num_documents


def _units_word(indexed: IndexedDataset, by_sequence: bool) -> str:
    return "sentences" if by_sequence and len(indexed) != indexed.num_documents else "documents"


def why_split_is_empty(data_paths, split: str, which: str, by_sequence: bool = False) -> str:
    """Why split `which` ("train", "valid" or "test") of `data_paths` holds no document: "--split S gives it no
    share", or its share and how few documents each source has to round it from (sequences with
    `by_sequence`, as GPT splits them). It names the fix."""
    parts = split_weights(split)
    share = parts[SPLIT_NAMES.index(which)] / sum(parts)
    if share == 0:
        return f"--split {split} gives the {which} split no share; give it one, e.g. --split 969,30,1"
    _, prefixes = parse_data_paths(data_paths)
    sources = [IndexedDataset(p) for p in prefixes]
    docs = [split_units(ds, by_sequence) for ds in sources]
    word = _units_word(sources[0], by_sequence)
    where = (f"of the {docs[0]} {word} in {prefixes[0]}, which rounds to none" if len(prefixes) == 1 else
             f"of each of the {len(prefixes)} sources ({', '.join(map(str, docs))} {word}), which rounds to none "
             "in each (each source is split on its own)")
    return f"--split {split} gives the {which} split {share:.1%} {where}; add {word} or raise its share"


def cache_key(**fields) -> str:
    """Stable short hash of the fields that determine an index."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_arrays(cache_dir: str, name: str, key: str, build) -> dict[str, np.ndarray]:
    """Load `{name}_{key}_{array}.npy` files, or call `build()` -> dict of arrays and save them.

    Each file is written to a temporary name and renamed, so a reader never sees a partial file and
    concurrent builders (several hosts) just overwrite each other with identical content.
    An unwritable cache directory only costs a rebuild next time.
    """
    stem = os.path.join(cache_dir, f"{name}_{key}")
    manifest = stem + ".json"
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                names = json.load(f)
            return {n: np.load(f"{stem}_{n}.npy", mmap_mode="r") for n in names}
        except (OSError, ValueError):
            pass  # damaged cache: rebuild below
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for n, a in arrays.items():
            _atomic_save(f"{stem}_{n}.npy", a)
        # The manifest goes last: its presence means every array is complete.
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(sorted(arrays), f)
        readable_by_all(tmp)
        os.replace(tmp, manifest)
    except OSError as e:
        print(f"warning: could not cache {name} index in {cache_dir} ({e}); it will be rebuilt "
              "next run.", file=sys.stderr)
    return arrays


def cached_index(kind: str, indexed, name: str, doc_range, cache_dir: str | None, build, by_sequence: bool = False,
                 **fields) -> dict[str, np.ndarray]:
    """`cached_arrays` for one split of one indexed dataset: keyed by the data (path, token count, and
    a digest of the split's sequence lengths, so data rebuilt under the same name with the same counts
    but other documents is not served a stale index), the split and `fields`; stored beside the data
    unless `cache_dir` is given. `doc_range` counts documents, or sequences with `by_sequence`."""
    lo, hi = doc_range if by_sequence else (int(indexed.doc_idx[i]) for i in doc_range)
    lengths = hashlib.sha256(np.ascontiguousarray(indexed.sizes[lo:hi]).tobytes()).hexdigest()[:16]
    key = cache_key(prefix=os.path.abspath(indexed.prefix), name=name, doc_range=list(doc_range),
                    num_tokens=int(indexed.tokens.size), lengths=lengths, **fields)
    cache_dir = cache_dir or os.path.dirname(os.path.abspath(indexed.prefix))
    return cached_arrays(cache_dir, f"{kind}_{os.path.basename(indexed.prefix)}_{name}", key, build)


def _atomic_save(path: str, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        readable_by_all(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending: sample `i` goes to the source whose count lags its target
    `weight * i` the most, so the running proportions track the weights at every prefix.

    Returns (dataset_index int16 [size], dataset_sample_index int64 [size]).
    """
    w = [float(x) for x in weights]
    n = len(w)
    counts = [0] * n
    ds_index = np.empty(size, dtype=np.int16)
    ds_sample = np.empty(size, dtype=np.int64)
    # A plain-Python loop (Megatron does this in C++): it is sequential by nature, costs about a
    # second per million samples with two sources, and runs once before being cached.
    rng_n = range(n)
    for i in range(size):
        t = max(i, 1)
        best, best_err = 0, w[0] * t - counts[0]
        for j in rng_n:
            err = w[j] * t - counts[j]
            if err > best_err:
                best, best_err = j, err
        ds_index[i] = best
        ds_sample[i] = counts[best]
        counts[best] += 1
    return ds_index, ds_sample


class BlendedDataset:
    """Weighted mixture of datasets; sample `i` is `datasets[dataset_index[i]][dataset_sample_index[i]]`."""

    def __init__(self, datasets, weights, size: int, cache_dir: str | None = None, key_fields=None):
        self.datasets = datasets
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        build = lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                 blending_indices(self.weights, size)))
        if cache_dir is None:
            arrays = build()
        else:
            key = cache_key(weights=self.weights, size=size, **(key_fields or {}))
            arrays = cached_arrays(cache_dir, "blend", key, build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i]) % len(self.datasets[d])]


def build_split_datasets(data_paths, split: str, num_samples, build_one, cache_dir=None,
                         key_fields=None, by_sequence: bool = False):
    """Build (train, valid, test) from Megatron-style `data_paths`, blending when weighted.

    `build_one(indexed, split_name, doc_range, n_samples, cache_dir)` makes one source's split
    dataset from its opened `IndexedDataset`; `doc_range` counts documents, or sequences with
    `by_sequence` (`split_units`). A split with no documents or no requested samples is None.
    """
    weights, prefixes = parse_data_paths(data_paths)
    sources = [IndexedDataset(p) for p in prefixes]
    per_prefix = [split_ranges(split, split_units(ds, by_sequence)) for ds in sources]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s]) if num_samples is not None else 0
        if n <= 0:
            out.append(None)
            continue
        parts, part_w = [], []
        for w, ds, ranges in zip(weights, sources, per_prefix):
            lo, hi = ranges[s]
            if hi <= lo or w == 0:
                continue
            # Ask each source for a little more than its share, as Megatron does (x1.005), so the
            # greedy assignment never runs a source past its end.
            want = n if len(prefixes) == 1 else int(np.ceil(n * w * 1.005)) + 1
            parts.append(build_one(ds, name, (lo, hi), want, cache_dir))
            part_w.append(w)
        if not parts:
            out.append(None)
        elif len(prefixes) == 1:
            out.append(parts[0])
        else:
            cdir = cache_dir or os.path.dirname(os.path.abspath(prefixes[0]))
            out.append(BlendedDataset(parts, part_w, n, cdir, dict(
                prefixes=[os.path.abspath(p) for p in prefixes], split=split, name=name,
                **(key_fields or {}))))
    return tuple(out)
