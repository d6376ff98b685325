"""Builds the tokenizer and the train / valid sample datasets a run asks for."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jax3d.config import Config, ConfigError


@dataclass
class Inputs:
    tokenizer: object
    train: object
    valid: object | None
    vocab_size: int  # the tokenizer's, before padding


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """The vocabulary padded to a multiple of `divisible_by` (and of tp, when tp does not divide that).

    Megatron pads to divisible_by x tp, which makes the padded size depend on the layout; here it does
    not, so a checkpoint restores onto any tensor-parallel size without a vocabulary change.
    """
    m = divisible_by if divisible_by % tp == 0 else divisible_by * tp
    return ((vocab + m - 1) // m) * m


def build_inputs(cfg: Config, num_train_samples: int, num_valid_samples: int) -> Inputs:
    """Tokenizer plus datasets from `--data-path`, or the bundled default corpus when it is empty."""
    from jax3d import data

    d, model = cfg.data, cfg.model
    kind = model.model_type
    if d.data_path:
        if not d.tokenizer_type:
            raise ConfigError("--data-path needs --tokenizer-type (and its --vocab-file / --merge-file / "
                              "--tokenizer-file) to know the vocabulary")
        tok = data.build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file or None,
                                   merge_file=d.merge_file or None, tokenizer_file=d.tokenizer_file or None)
        paths = list(d.data_path)
    else:
        prefix, tok = data.default_corpus(cache_dir=d.cache_dir or None, kind=kind)
        paths = [prefix]
    num = (num_train_samples, num_valid_samples, 0)
    if kind == "bert":
        train, valid, _ = data.build_bert_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                   tok, cache_dir=d.cache_dir or None)
    else:
        train, valid, _ = data.build_gpt_datasets(paths, d.split, model.seq_length, num, cfg.train.seed,
                                                  cache_dir=d.cache_dir or None)
    return Inputs(tok, train, valid, tok.vocab_size)


def with_vocab(cfg: Config, vocab_size: int, divisible_by: int, forced: int = 0) -> Config:
    """The config with the model vocabulary set from the tokenizer (or `--vocab-size` when forced)."""
    tp = cfg.parallel.tensor_parallel
    vocab = padded_vocab(vocab_size, divisible_by, tp)
    if forced:
        if forced < vocab_size:
            raise ConfigError(f"--vocab-size {forced} is smaller than the tokenizer's {vocab_size} tokens")
        vocab = forced
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
