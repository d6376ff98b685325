"""BERT sentence-pair samples with masked-LM targets, Megatron's construction.

Source: a sentence-split indexed dataset (one sequence per sentence, `doc_idx` marks documents).
A sample takes consecutive sentences of one document, cuts them into segments A and B at a random
sentence boundary, swaps A and B half the time (`is_random` = 1, the sentence-order target), and
lays out `[CLS] A [SEP] B [SEP]` padded to `seq_length`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax3d.data.indexed import DataError, IndexedDataset
from jax3d.data.sampling import build_split_datasets, cached_index

LONG_SENTENCE = 512  # Megatron skips documents holding a sentence longer than this


@dataclass(frozen=True)
class BertTokenIds:
    """Special-token ids and vocabulary size the masking needs (from a BERT tokenizer)."""
    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tok) -> "BertTokenIds":
        missing = [f"[{n.upper()}]" for n in ("cls", "sep", "mask", "pad") if getattr(tok, n, None) is None]
        if missing:
            raise DataError(f"BERT needs [CLS], [SEP], [MASK] and [PAD] tokens and the {type(tok).__name__} "
                            f"has no {', '.join(missing)}; use --tokenizer-type BertWordPieceLowerCase or "
                            "BertWordPieceCase")
        return cls(tok.cls, tok.sep, tok.mask, tok.pad, tok.vocab_size)


def build_samples_mapping(sizes, doc_idx, doc_range, max_num_tokens: int, num_samples: int,
                          seed: int, short_seq_prob: float = 0.1, what: str = "the split") -> np.ndarray:
    """Rows (first sentence, end sentence, target length): each a run of >= 2 sentences of one
    document, about `target` tokens long, then shuffled. Passes over the documents (one per epoch,
    new random targets each time) until `num_samples` rows exist. `what` names the data in errors."""
    rng = np.random.RandomState(seed)
    sizes = np.asarray(sizes)
    short_ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0

    def target():
        # As Megatron: one sample in `short_ratio` gets a random short target, to train on short
        # inputs too.
        if short_ratio and rng.randint(short_ratio) == 0:
            return 2 + rng.randint(max_num_tokens - 1)
        return max_num_tokens

    rows = []
    usable = [d for d in range(*doc_range)
              if doc_idx[d + 1] - doc_idx[d] >= 2
              and sizes[doc_idx[d]:doc_idx[d + 1]].max() <= LONG_SENTENCE]
    if not usable:
        raise DataError(f"no document in {what} has two or more sentences; BERT needs a "
                        "sentence-split dataset (preprocess with --split-sentences).")
    while len(rows) < num_samples:
        for d in usable:
            first, last = int(doc_idx[d]), int(doc_idx[d + 1])
            start, length, count, want = first, 0, 0, target()
            for s in range(first, last):
                length += int(sizes[s])
                count += 1
                remain = last - s - 1
                # Cut when long enough, but never leave a single sentence behind for the next sample.
                if (length >= want and remain > 1 and count >= 2) or remain == 0:
                    rows.append((start, s + 1, want))
                    start, length, count, want = s + 1, 0, 0, target()
    mapping = np.asarray(rows, dtype=np.int64)
    return mapping[rng.permutation(len(mapping))]


def _truncate(a: list, b: list, max_tokens: int, rng) -> None:
    """Drop tokens from the longer segment, front or back at random, until both fit."""
    while len(a) + len(b) > max_tokens:
        seg = a if len(a) > len(b) else b
        if rng.random_sample() < 0.5:
            del seg[0]
        else:
            seg.pop()


def mask_tokens(tokens: np.ndarray, special: np.ndarray, ids: BertTokenIds, rng,
                masked_lm_prob: float = 0.15):
    """Choose round(prob * candidates) non-special positions; replace 80% with [MASK], 10% with a
    random id, keep 10%. Returns (masked tokens, labels (-1 or original), loss_mask)."""
    cand = np.flatnonzero(~special)
    n_pick = min(len(cand), max(1, int(round(len(cand) * masked_lm_prob)))) if len(cand) else 0
    picked = np.sort(rng.permutation(cand)[:n_pick])
    out = tokens.copy()
    labels = np.full(tokens.shape, -1, np.int32)
    loss_mask = np.zeros(tokens.shape, np.int32)
    labels[picked] = tokens[picked]
    loss_mask[picked] = 1
    r = rng.random_sample(n_pick)
    out[picked[r < 0.8]] = ids.mask
    rand_pos = picked[r >= 0.9]
    out[rand_pos] = rng.randint(0, ids.vocab_size, len(rand_pos))
    return out, labels, loss_mask


class BertDataset:
    """`ds[i]` -> dict of `text`, `types`, `labels`, `loss_mask`, `padding_mask` (int32 [S]) and
    `is_random` (int32 scalar); deterministic in (seed, i)."""

    def __init__(self, indexed: IndexedDataset, name: str, doc_range, seq_length: int,
                 num_samples: int, seed: int, ids: BertTokenIds, cache_dir: str | None = None,
                 masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1):
        if seq_length < 5:
            raise DataError(f"--seq-length {seq_length} is too short for [CLS] A [SEP] B [SEP].")
        self.indexed, self.name, self.seq_length, self.seed = indexed, name, seq_length, seed
        self.ids, self.masked_lm_prob = ids, masked_lm_prob
        self.samples_mapping = cached_index(
            "bert", indexed, name, doc_range, cache_dir,
            lambda: {"mapping": build_samples_mapping(indexed.sizes, indexed.doc_idx, doc_range,
                                                      seq_length - 3, num_samples, seed,
                                                      short_seq_prob, f"the {name} split of {indexed.prefix}")},
            seq_length=seq_length, num_samples=num_samples, seed=seed,
            short_seq_prob=short_seq_prob)["mapping"]

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def __getitem__(self, i: int) -> dict:
        start, end, target = (int(x) for x in self.samples_mapping[i])
        rng = np.random.RandomState((self.seed + i) % 2**32)
        sents = [self.indexed[s].tolist() for s in range(start, end)]
        # Cut point: A gets 1 .. n-1 leading sentences.
        a_end = 1 + rng.randint(len(sents) - 1)
        a = [t for s in sents[:a_end] for t in s]
        b = [t for s in sents[a_end:] for t in s]
        is_random = rng.random_sample() < 0.5
        if is_random:
            a, b = b, a
        _truncate(a, b, target, rng)
        ids = self.ids
        tokens = np.asarray([ids.cls] + a + [ids.sep] + b + [ids.sep], np.int32)
        types = np.asarray([0] * (len(a) + 2) + [1] * (len(b) + 1), np.int32)
        special = np.zeros(len(tokens), bool)
        special[[0, len(a) + 1, len(tokens) - 1]] = True
        masked, labels, loss_mask = mask_tokens(tokens, special, ids, rng, self.masked_lm_prob)
        n, pad = len(tokens), self.seq_length - len(tokens)

        def padded(x, value):
            return np.concatenate([x, np.full(pad, value, np.int32)]).astype(np.int32)

        return {
            "text": padded(masked, ids.pad),
            "types": padded(types, 0),
            "labels": padded(labels, -1),
            "loss_mask": padded(loss_mask, 0),
            "padding_mask": padded(np.ones(n, np.int32), 0),
            "is_random": np.int32(is_random),
        }


def build_bert_datasets(data_paths, split: str, seq_length: int, num_samples, seed: int,
                        token_ids: BertTokenIds, cache_dir: str | None = None,
                        masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1):
    """(train, valid, test) BERT datasets from sentence-split data, Megatron's `--data-path` and
    `--split` spelling; `token_ids` is a `BertTokenIds` or a BERT tokenizer (anything with
    `cls`, `sep`, `mask`, `pad`, `vocab_size`). Empty splits are None."""
    if not isinstance(token_ids, BertTokenIds):
        token_ids = BertTokenIds.from_tokenizer(token_ids)

    def build_one(indexed, name, doc_range, n, cdir):
        return BertDataset(indexed, name, doc_range, seq_length, n, seed, token_ids,
                           cdir, masked_lm_prob, short_seq_prob)

    return build_split_datasets(data_paths, split, num_samples, build_one, cache_dir,
                                dict(seq_length=seq_length, seed=seed, kind="bert"))
