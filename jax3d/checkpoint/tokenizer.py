"""A checkpoint's tokenizer: what it records (type, size, files and their fingerprints, copies of the files kept
in `<checkpoint>/tokenizer/`), the one function that builds it again, and the check that a run resuming or
fine-tuning a checkpoint reads text with the same tokenizer."""
from __future__ import annotations

import os
import sys

import jax

from jax3d.checkpoint.read import list_steps, read_meta, resolve_step
from jax3d.config import TOKENIZER_FILE_KEYS, Config, ConfigError
from jax3d.data.tokenizers import TOKENIZER_TYPES, DataError, build_tokenizer

BUNDLED_TOKENIZER = "bundled default corpus tokenizer"  # a tokenizer record's note for the bundled corpus
# An import without tokenizer files, or code that gave Checkpointer no tokenizer (the words predate the latter
# and stay, so that older checkpoints still read as they were written).
NO_TOKENIZER = "imported without tokenizer files"


def tokenizer_info(cfg: Config, tokenizer=None) -> dict:
    """What a checkpoint records about the tokenizer: type, vocabulary size and its files."""
    d = cfg.data
    info = {"type": d.tokenizer_type or (type(tokenizer).__name__ if tokenizer is not None else ""),
            "vocab_size": int(tokenizer.vocab_size) if tokenizer is not None else None,
            "padded_vocab_size": cfg.model.vocab_size,
            # absolute, so generation, evaluation and export find them from any folder
            **{k: os.path.abspath(getattr(d, k)) if getattr(d, k) else "" for k in TOKENIZER_FILE_KEYS}}
    if not d.tokenizer_type and not d.data_path:
        # The bundled corpus's, when the run passes it or its model has that vocabulary. Code that trained on ids
        # of its own, of another vocabulary, records none: the bundled files would decode them as other words.
        from jax3d.data.default_corpus import VOCAB_SIZE
        bundled = tokenizer is not None or cfg.model.vocab_size == VOCAB_SIZE
        info["note"] = BUNDLED_TOKENIZER if bundled else NO_TOKENIZER
        if tokenizer is not None:
            # Its files, which the first save copies into the checkpoint: a cache rebuilt elsewhere (another
            # Python's sources) would learn another tokenizer.
            from jax3d.data.default_corpus import tokenizer_files
            files = tokenizer_files(d.cache_dir or None, cfg.model.model_type)
            info.update({k: os.path.abspath(v) for k, v in files.items()})
    from jax3d.checkpoint.record import tokenizer_fingerprints
    info["fingerprints"] = tokenizer_fingerprints(info)
    return info


def kept_in(save_dir: str, info: dict) -> dict:
    """The tokenizer record `info` with its files copied into `<save_dir>/tokenizer/`, so that a checkpoint
    does not depend on files outside it (a fine-tune's tokenizer sat in the base model's folder). Files already
    in the checkpoint, or whose name there holds other bytes, stay where they are."""
    import filecmp
    import shutil

    keep = os.path.join(os.path.abspath(save_dir), "tokenizer")
    out = dict(info)
    for key in TOKENIZER_FILE_KEYS:
        src = info.get(key)
        if not src or not os.path.isfile(src) or os.path.abspath(src).startswith(os.path.abspath(save_dir) + os.sep):
            continue
        dst = os.path.join(keep, os.path.basename(src))
        if jax.process_index() == 0 and not os.path.exists(dst):
            os.makedirs(keep, exist_ok=True)
            shutil.copyfile(src, dst)
        if os.path.exists(dst) and filecmp.cmp(src, dst, shallow=False):
            out[key] = dst
    return out


# Text both tokenizers of a fine-tune read, to tell two vocabularies of one size apart: prose and code.
_PROBE = "The model's 3 layers read text, then code:\n    def main(argv=None):\n        return {'ok': 0}\n"


def check_same_tokenizer(load_dir: str, step: int, tokenizer) -> None:
    """ConfigError when checkpoint `load_dir` (step `step`, -1 the latest) was trained on another tokenizer
    than `tokenizer`, whose ids would read the wrong embeddings: a smaller vocabulary, or one of the same
    size that reads a probe text otherwise (when the checkpoint's files are at hand). A larger one (the
    checkpoint's plus added tokens) is allowed with a note."""
    found = list_steps(load_dir)
    if not found or tokenizer is None:
        return
    meta = read_meta(load_dir, resolve_step(load_dir, found, step))
    saved = meta.get("tokenizer") or {}
    had, has = int(saved.get("vocab_size") or 0), int(tokenizer.vocab_size)
    which = ("the bundled corpus's, used without --data-path" if saved.get("note") == BUNDLED_TOKENIZER
             else saved.get("vocab_file") or saved.get("tokenizer_file") or saved.get("type"))
    if had and has < had:
        raise ConfigError(f"--load {load_dir} was trained on a tokenizer of {had} tokens and this run's has {has}; "
                          f"preprocess the data with the checkpoint's tokenizer ({which})")
    own = None
    if had == has and hasattr(tokenizer, "tokenize"):
        try:
            own = checkpoint_tokenizer(meta, required=False)
        except (DataError, OSError):  # files it can't read: the size check above is all there is
            pass
    if own is not None and own.tokenize(_PROBE) != tokenizer.tokenize(_PROBE):
        raise ConfigError(f"--load {load_dir} was trained on another tokenizer of the same {has} tokens (it reads "
                          f"text differently from this run's); preprocess the data with the checkpoint's tokenizer "
                          f"({which}; its files are in {os.path.join(load_dir, 'tokenizer')})")
    if had and has > had:
        _log(f"jax3d: this run's tokenizer has {has} tokens, {has - had} more than the checkpoint's; "
             "their embeddings are the checkpoint's padding rows, as yet untrained")


def tokenizer_record(meta: dict) -> dict:
    """A checkpoint's tokenizer record (its metadata `meta`). A run on the bundled corpus saved before the files
    were kept with the checkpoint recorded none: they are the corpus cache's (under its --data-cache-path)."""
    from jax3d.data.default_corpus import tokenizer_files

    record = dict(meta.get("tokenizer") or {})
    if record.get("note") == BUNDLED_TOKENIZER and not any(record.get(k) for k in TOKENIZER_FILE_KEYS):
        config = meta.get("config") or {}
        record.update(tokenizer_files((config.get("data") or {}).get("cache_dir") or None,
                                      (config.get("model") or {}).get("model_type", "gpt")))
    return record


def checkpoint_tokenizer(meta: dict, required: bool = True):
    """The tokenizer a checkpoint (its metadata `meta`) was trained or imported with, built from its recorded
    files (`read_meta` points at the copies kept in the checkpoint when those are gone). When it can't be built
    (an import without tokenizer files, a file gone), ConfigError naming the fix, or None unless `required`.
    A bundled-corpus run whose files are nowhere rebuilds the corpus cache, when `required`. Unreadable files
    raise DataError."""
    record = tokenizer_record(meta)
    files = {k: record.get(k) or None for k in TOKENIZER_FILE_KEYS}
    problem = _problem(record)
    if problem is None and record.get("type") in TOKENIZER_TYPES and any(files.values()):
        return build_tokenizer(record["type"], **files)
    if problem is None and required:  # the bundled corpus's, with its files nowhere: rebuilt in its cache
        from jax3d.data import default_corpus
        config = meta.get("config") or {}
        return default_corpus(cache_dir=(config.get("data") or {}).get("cache_dir") or None,
                              kind=(config.get("model") or {}).get("model_type", "gpt"))[1]
    if problem and required:
        raise ConfigError(problem)
    return None


def _problem(record: dict) -> str | None:
    """Why tokenizer record `record` can't be built again (no tokenizer recorded, a file gone), or None."""
    missing = [record[k] for k in TOKENIZER_FILE_KEYS if record.get(k) and not os.path.exists(record[k])]
    if record.get("note") == NO_TOKENIZER:
        return ("the checkpoint records no tokenizer (it was imported without tokenizer files, or saved by code "
                "that gave Checkpointer none); import it again from a folder that has them (vocab.json and "
                "merges.txt, vocab.txt, tokenizer.json or tokenizer.model), or save it with Checkpointer(cfg, "
                "tokenizer)")
    if missing:
        return (f"the checkpoint's tokenizer file {missing[0]} does not exist; put it back there, or run from "
                "the folder training ran in if the path is relative")
    return None


def recorded_tokenizer_fields(meta: dict) -> dict:
    """The DataConfig fields (`tokenizer_type` and its files) of the tokenizer a checkpoint (its metadata
    `meta`) was trained or imported with, its files where they are now; {} when it records none that has
    files. ConfigError when a file is gone."""
    record = tokenizer_record(meta)
    if record.get("note") == NO_TOKENIZER or record.get("type") not in TOKENIZER_TYPES or \
            not any(record.get(k) for k in TOKENIZER_FILE_KEYS):
        return {}
    problem = _problem(record)
    if problem:
        raise ConfigError(problem)
    return {"tokenizer_type": record["type"], **{k: record.get(k) or "" for k in TOKENIZER_FILE_KEYS}}


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)
