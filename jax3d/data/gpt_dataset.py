"""GPT samples with Megatron's semantics: fixed-length windows over the token stream of shuffled
documents, crossing document boundaries (preprocessing put EOD between documents).

As in Megatron's GPT dataset, the documents are the indexed dataset's sequences: in data preprocessed
with --split-sentences each sentence is one."""
from __future__ import annotations

import numpy as np

from jax3d.data.indexed import DataError, IndexedDataset
from jax3d.data.sampling import build_split_datasets, cached_index


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give `num_samples` windows of `seq_length + 1` tokens
    (windows overlap by one token, the next-token target)."""
    if tokens_per_epoch <= 0:
        raise DataError("the dataset split has no tokens; use more documents or change --split.")
    # samples(e) = (e * tokens - 1) // seq_length, so solve for e directly.
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_gpt_indices(sizes: np.ndarray, doc_range: tuple[int, int], seq_length: int,
                      num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """Doc index, sample index and shuffle index, all vectorised.

    - doc_idx [epochs * docs]: document ids, each epoch a fresh permutation of the split's docs;
    - sample_idx [n + 1, 2]: (position in doc_idx, token offset) where sample i starts; sample i
      runs up to and including sample i+1's start token;
    - shuffle_idx [n]: the order samples are served in.

    Unlike Megatron, which shuffles all epochs' documents as one list, each epoch here is its own
    permutation, so every document is seen once per epoch.
    """
    rng = np.random.RandomState(seed)
    docs = np.arange(*doc_range, dtype=np.int64)
    epochs = num_epochs_needed(int(sizes[docs].sum()), seq_length, num_samples)
    doc_idx = np.concatenate([rng.permutation(docs) for _ in range(epochs)])
    ends = np.cumsum(sizes[doc_idx].astype(np.int64))  # token position where each doc_idx entry ends
    n = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    # side="right": a start that lands exactly on a document end belongs to the next document,
    # which also steps over empty documents.
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - sizes[doc_idx[pos]])
    sample_idx = np.stack([pos, offset], axis=1).astype(np.int64)
    # As Megatron: if the last epoch is mostly unused (< 80% of its samples needed), shuffle its
    # samples separately and serve them last, so the first `num_samples` are drawn from whole
    # epochs rather than favouring the documents the last epoch happens to put first.
    tokens_per_epoch = int(ends[-1]) // epochs
    first = max(0, ((epochs - 1) * tokens_per_epoch - 1) // seq_length)
    per_epoch = (tokens_per_epoch - 1) // seq_length
    if epochs > 1 and num_samples - first < int(0.8 * per_epoch):
        shuffle_idx = np.concatenate([rng.permutation(first), first + rng.permutation(n - first)])
    else:
        shuffle_idx = rng.permutation(n)
    shuffle_idx = shuffle_idx.astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


class GPTDataset:
    """`ds[i] == {"text": int32 [seq_length + 1]}`; `len(ds)` is every full window of the epochs
    needed for `num_samples` (at least `num_samples`)."""

    def __init__(self, indexed: IndexedDataset, name: str, doc_range, seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | None = None):
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        arrays = cached_index("gpt", indexed, name, doc_range, cache_dir,
                              lambda: build_gpt_indices(indexed.sizes, doc_range, seq_length,
                                                        num_samples, seed),
                              by_sequence=True, seq_length=seq_length, num_samples=num_samples, seed=seed)
        self.doc_idx, self.sample_idx = arrays["doc_idx"], arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def unshuffled(self, j: int) -> np.ndarray:
        """Tokens of the j-th window in stream order (before the sample shuffle)."""
        (d0, off0), (d1, off1) = self.sample_idx[j], self.sample_idx[j + 1]
        get = self.indexed.get
        if d0 == d1:
            return np.asarray(get(int(self.doc_idx[d0]), int(off0), int(off1 - off0 + 1)), np.int32)
        pieces = [get(int(self.doc_idx[d0]), int(off0))]
        pieces += [get(int(self.doc_idx[d])) for d in range(d0 + 1, d1)]
        pieces.append(get(int(self.doc_idx[d1]), 0, int(off1) + 1))
        return np.concatenate(pieces).astype(np.int32)

    def __getitem__(self, i: int) -> dict:
        return {"text": self.unshuffled(int(self.shuffle_idx[i]))}


def build_gpt_datasets(data_paths, split: str, seq_length: int, num_samples, seed: int,
                       cache_dir: str | None = None):
    """(train, valid, test) GPT datasets from Megatron's `--data-path` / `--split` spelling.

    `data_paths`: `["prefix"]` or `["0.3", "prefixA", "0.7", "prefixB"]`; `num_samples`:
    (train, valid, test) counts. A split with no documents or 0 samples comes back as None.
    Indices are cached as .npy beside the data (or in `cache_dir`).
    """
    if seq_length < 1:
        raise DataError(f"--seq-length {seq_length} must be positive.")

    def build_one(indexed, name, doc_range, n, cdir):
        return GPTDataset(indexed, name, doc_range, seq_length, n, seed, cdir)

    return build_split_datasets(data_paths, split, num_samples, build_one, cache_dir,
                                dict(seq_length=seq_length, seed=seed, kind="gpt"), by_sequence=True)
