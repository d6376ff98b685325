"""Builds the tokenizer and the train / valid sample datasets a run asks for."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from jax3d.config import TOKENIZER_FILE_KEYS, Config, ConfigError


@dataclass
class Inputs:
    """A run's tokenizer and its sample datasets (`valid` None when validation is off)."""

    tokenizer: object
    train: object
    valid: object | None


def tokenizer_and_paths(cfg: Config):
    """The run's tokenizer and its data-path prefixes: `--data-path`, or the bundled default corpus when empty."""
    from jax3d import data

    d = cfg.data
    if d.data_path:
        if not d.tokenizer_type:
            raise ConfigError("--data-path needs --tokenizer-type (and its --vocab-file / --merge-file / "
                              "--tokenizer-file / --tokenizer-model) to know the vocabulary")
        tok = data.build_tokenizer(d.tokenizer_type, **{k: getattr(d, k) or None for k in TOKENIZER_FILE_KEYS})
        check_token_ids(d.data_path, tok.vocab_size)
        check_tokenized_by(d.data_path, tok)
        return tok, list(d.data_path)
    prefix, tok = data.default_corpus(cache_dir=d.cache_dir or None, kind=cfg.model.model_type)
    return tok, [prefix]


def check_token_ids(data_paths, vocab_size: int, sample: int = 1 << 22, windows: int = 16) -> None:
    """Refuses `--data-path` data whose token ids do not fit the tokenizer: data preprocessed with another
    vocabulary would index past the embedding table and train on NaN. A prefix of more than `sample`
    tokens is checked in `windows` stretches spread from its start to its end (a blend of files, one of
    another vocabulary, has it anywhere), which keeps the check to a few MB read."""
    import numpy as np

    from jax3d import data

    for prefix in data.parse_data_paths(list(data_paths))[1]:
        tokens = data.IndexedDataset(prefix).tokens
        if tokens.size > sample:
            width = sample // windows
            starts = np.linspace(0, tokens.size - width, windows).astype(np.int64)
            tokens = np.concatenate([tokens[s:s + width] for s in starts])
        top = int(tokens.max()) if tokens.size else -1
        if top >= vocab_size:
            raise ConfigError(f"--data-path {prefix} holds token id {top}, but the tokenizer has {vocab_size} "
                              "tokens; pass the tokenizer files the data was preprocessed with")


# A document of `data` tokenized by `tok` reads back as the same ids: tok.tokenize(tok.detokenize(ids)) == ids,
# all but a token or two where a window's cut splits a word. Another tokenizer's ids decode to other text, which
# `tok` tokenizes otherwise: two byte-level BPEs of 2,000 tokens learnt from two sets of Python sources agreed on
# 79-92% of the ids (their first merges are the same), a tokenizer with its own data on 100%. Below this share of
# ids agreeing, the data is taken for another tokenizer's.
SAME_TOKENIZER_AGREEMENT = 0.97


def check_tokenized_by(data_paths, tok, whose: str = "this run's",
                       fix: str = "pass the tokenizer files the data was preprocessed with",
                       docs: int = 8, window: int = 256) -> None:
    """ConfigError when `data_paths` was tokenized by another tokenizer than `tok`, though its ids fit `tok`'s
    vocabulary (check_token_ids): `docs` documents spread over each prefix, up to `window` tokens each, are
    decoded and encoded again, and too few ids come back."""
    import difflib

    import numpy as np

    from jax3d import data

    if not hasattr(tok, "detokenize"):
        return
    special = {i for i in (getattr(tok, k, None) for k in ("eod", "cls", "sep", "pad", "mask")) if i is not None}
    for prefix in data.parse_data_paths(list(data_paths))[1]:
        ds = data.IndexedDataset(prefix)
        same = total = 0
        for i in np.unique(np.linspace(0, len(ds) - 1, min(docs, len(ds))).astype(np.int64)) if len(ds) else []:
            ids = [int(t) for t in np.asarray(ds[int(i)])[:window] if int(t) not in special]
            again = tok.tokenize(tok.detokenize(ids))
            same += sum(b.size for b in difflib.SequenceMatcher(None, ids, again, autojunk=False).get_matching_blocks())
            total += len(ids)
        if total and same / total < SAME_TOKENIZER_AGREEMENT:
            raise ConfigError(f"--data-path {prefix} was tokenized by another tokenizer than {whose} (only "
                              f"{same / total:.0%} of its ids read back the same); {fix}")


def build_inputs(cfg: Config, num_train_samples: int, num_valid_samples: int, tok=None, paths=None) -> Inputs:
    """Tokenizer plus train / valid datasets (`tok` and `paths` as `tokenizer_and_paths` gives them)."""
    from jax3d import data

    if tok is None:
        tok, paths = tokenizer_and_paths(cfg)
    d, model = cfg.data, cfg.model
    num = (num_train_samples, num_valid_samples, 0)
    if model.model_type == "bert":
        train, valid, _ = data.build_bert_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                   tok, cache_dir=d.cache_dir or None, masked_lm_prob=d.mask_prob,
                                                   short_seq_prob=d.short_seq_prob)
    else:
        train, valid, _ = data.build_gpt_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                  cache_dir=d.cache_dir or None)
    from jax3d.data.sampling import why_split_is_empty
    if train is None:
        raise ConfigError(why_split_is_empty(paths, d.split, "train"))
    if num_valid_samples and valid is None:
        print(f"jax3d: this run does not validate: {why_split_is_empty(paths, d.split, 'valid')}", file=sys.stderr)
    return Inputs(tok, train, valid)
