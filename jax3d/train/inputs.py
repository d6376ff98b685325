"""Builds the tokenizer and the train / valid sample datasets a run asks for."""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from jax3d.config import TOKENIZER_FILE_KEYS, Config, ConfigError


@dataclass
class Inputs:
    """A run's tokenizer and its sample datasets (`valid` None when validation is off)."""

    tokenizer: object
    train: object
    valid: object | None


def with_default_tokenizer(cfg: Config) -> Config:
    """`cfg` with the `--tokenizer-type` its tokenizer files imply where `--data-path` is given without one
    (`default_tokenizer_type`: Megatron's GPT2BPETokenizer for a GPT or Llama, BertWordPieceLowerCase for a
    BERT). A run with `--load` takes the checkpoint's tokenizer before this (jax3d.train.resume)."""
    from jax3d.data.tokenizers import default_tokenizer_type

    d = cfg.data
    if not d.all_paths or d.tokenizer_type:
        return cfg
    kind = default_tokenizer_type(cfg.model.model_type, **{k: getattr(d, k) for k in TOKENIZER_FILE_KEYS})
    return dataclasses.replace(cfg, data=dataclasses.replace(d, tokenizer_type=kind)) if kind else cfg


def tokenizer_and_paths(cfg: Config):
    """The run's tokenizer and its data-path prefixes: `--data-path`, or the bundled default corpus when empty
    and no split has its own data (`--train-data-path` etc., which the paths then leave to `build_inputs`)."""
    from jax3d import data

    d = with_default_tokenizer(cfg).data
    if d.all_paths:
        if not d.tokenizer_type:
            flag = "--data-path" if d.data_path else f"--{next(iter(d.split_paths))}-data-path"
            raise ConfigError(f"{flag} needs the tokenizer it was preprocessed with: pass its --vocab-file "
                              "(and --merge-file), --tokenizer-model or --tokenizer-file, with --tokenizer-type "
                              "where the default (GPT2BPETokenizer for GPT, BertWordPieceLowerCase for BERT) "
                              "is not its type")
        tok = data.build_tokenizer(d.tokenizer_type, **{k: getattr(d, k) or None for k in TOKENIZER_FILE_KEYS})
        for paths in d.all_paths:
            check_token_ids(paths, tok.vocab_size)
            check_tokenized_by(paths, tok)
        return tok, list(d.data_path)
    prefix, tok = data.default_corpus(cache_dir=d.cache_dir or None, kind=cfg.model.model_type)
    return tok, [prefix]


def with_eod_token(cfg: Config, tok) -> Config:
    """`cfg` with the tokenizer's end-of-document id where the model reads it (--eod-mask-loss,
    --reset-position-ids, --reset-attention-mask); ConfigError when the tokenizer has none."""
    if not cfg.model.uses_eod:
        return cfg
    eod = getattr(tok, "eod", None)
    if eod is None:
        raise ConfigError(f"--eod-mask-loss, --reset-position-ids and --reset-attention-mask split samples at the "
                          f"end-of-document token, and this {type(tok).__name__} has none; drop them or use a "
                          "tokenizer with one")
    return cfg.replace(model={"eod_token_id": int(eod)})


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
    """Tokenizer plus train / valid datasets (`tok` and `paths` as `tokenizer_and_paths` gives them): from
    `--data-path` and `--split`, or each from its split's own `--*-data-path`."""
    from jax3d.data.sampling import why_split_is_empty

    if tok is None:
        tok, paths = tokenizer_and_paths(cfg)
    d = cfg.data
    if d.split_paths:
        train = split_dataset(cfg, tok, "train", num_train_samples)
        valid = split_dataset(cfg, tok, "valid", num_valid_samples) if num_valid_samples else None
        if num_valid_samples and not d.valid_data_path:
            print("jax3d: this run does not validate: --train-data-path is given without --valid-data-path",
                  file=sys.stderr)
        return Inputs(tok, train, valid)
    num = (num_train_samples, num_valid_samples, 0)
    train, valid, _ = _datasets(cfg, tok, paths, d.split, num)
    by_sequence = cfg.model.model_type != "bert"
    if train is None:
        raise ConfigError(why_split_is_empty(paths, d.split, "train", by_sequence))
    if num_valid_samples and valid is None:
        print(f"jax3d: this run does not validate: {why_split_is_empty(paths, d.split, 'valid', by_sequence)}",
              file=sys.stderr)
    return Inputs(tok, train, valid)


# The --split that reads a whole source as one split, as Megatron reads a --train/valid/test-data-path.
WHOLE_SPLIT = {"train": "1,0,0", "valid": "0,1,0", "test": "0,0,1"}


def split_dataset(cfg: Config, tok, which: str, num_samples: int):
    """`num_samples` of split `which` from its own --{which}-data-path, every document of it (None when that is
    not given); ConfigError when it holds no document."""
    paths = cfg.data.split_paths.get(which)
    if not paths:
        return None
    i = ("train", "valid", "test").index(which)
    num = [0, 0, 0]
    num[i] = num_samples
    out = _datasets(cfg, tok, list(paths), WHOLE_SPLIT[which], num)[i]
    if out is None and num_samples:
        raise ConfigError(f"--{which}-data-path {' '.join(paths)} holds no document; pass a non-empty dataset")
    return out


def _datasets(cfg: Config, tok, paths, split: str, num):
    from jax3d import data

    d, model = cfg.data, cfg.model
    if model.model_type == "bert":
        return data.build_bert_datasets(paths, split, model.seq_length, num, cfg.train.seed, tok,
                                        cache_dir=d.cache_dir or None, masked_lm_prob=d.mask_prob,
                                        short_seq_prob=d.short_seq_prob)
    return data.build_gpt_datasets(paths, split, model.seq_length, num, cfg.train.seed, cache_dir=d.cache_dir or None)
