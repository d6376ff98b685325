"""Builds the tokenizer and the train / valid sample datasets a run asks for."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from jax3d.config import Config, ConfigError


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
                              "--tokenizer-file) to know the vocabulary")
        tok = data.build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file or None,
                                   merge_file=d.merge_file or None, tokenizer_file=d.tokenizer_file or None)
        check_token_ids(d.data_path, tok.vocab_size)
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


def build_inputs(cfg: Config, num_train_samples: int, num_valid_samples: int, tok=None, paths=None) -> Inputs:
    """Tokenizer plus train / valid datasets (`tok` and `paths` as `tokenizer_and_paths` gives them)."""
    from jax3d import data

    if tok is None:
        tok, paths = tokenizer_and_paths(cfg)
    d, model = cfg.data, cfg.model
    num = (num_train_samples, num_valid_samples, 0)
    if model.model_type == "bert":
        train, valid, _ = data.build_bert_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                   tok, cache_dir=d.cache_dir or None)
    else:
        train, valid, _ = data.build_gpt_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                  cache_dir=d.cache_dir or None)
    from jax3d.data.sampling import why_split_is_empty
    if train is None:
        raise ConfigError(why_split_is_empty(paths, d.split, "train"))
    if num_valid_samples and valid is None:
        print(f"jax3d: this run does not validate: {why_split_is_empty(paths, d.split, 'valid')}", file=sys.stderr)
    return Inputs(tok, train, valid)
