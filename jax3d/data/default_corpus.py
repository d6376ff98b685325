"""A corpus that every machine has: the Python standard library's own source files.

`default_corpus()` trains a tokenizer on them and writes a Megatron `.bin/.idx` dataset once, then
serves it from a cache, so the training job runs with no download and no user data.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time

from jax3d.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype, dataset_exists
from jax3d.data.tokenizers import build_tokenizer, train_tokenizer

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_BUILD_VERSION = 3  # bump when the corpus recipe changes, so old caches are not reused


def stdlib_files(max_bytes: int = 8_000_000) -> list[str]:
    """Sorted stdlib `*.py` paths (no site-packages or test dirs), capped at `max_bytes` in total."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    paths.sort()
    out, total = [], 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0 or total + size > max_bytes:
            continue  # a smaller later file may still fit; keeps the cap tight
        out.append(p)
        total += size
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _with_indent(line: str) -> str:
    """`    return x` -> `§ return x`: one mark per indentation level of four columns."""
    body = line.lstrip(" \t")
    depth = len(line.expandtabs(4)) - len(body.expandtabs(4))
    return "§ " * (depth // 4) + body


_DEFINITION = re.compile(r"\s*(async\s+def|def|class)\s")


def definition_blocks(text: str) -> list[list[str]]:
    """Split a source file's non-blank lines into blocks, a new one at each `def`, `async def` or
    `class` line (its decorators go with it). The lines before the first definition are a block, and
    a class body up to its first method stays with the class line. Every non-blank line lands in
    exactly one block, in file order."""
    blocks, current, decorators = [], [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("@"):
            decorators.append(line)
            continue
        if _DEFINITION.match(line) and current:
            blocks.append(current)
            current = []
        current += decorators + [line]
        decorators = []
    current += decorators
    if current:
        blocks.append(current)
    return blocks


def _log(msg: str) -> None:
    print(f"[default_corpus] {msg}", file=sys.stderr, flush=True)


def _build(work: str, kind: str, vocab_size: int, max_bytes: int) -> None:
    t0 = time.perf_counter()
    files = stdlib_files(max_bytes)
    texts = [_read(p) for p in files]
    _log(f"{len(files)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} MB of text; training "
         f"{'byte-level BPE' if kind == 'gpt' else 'WordPiece'} with {vocab_size} ids")
    if kind == "gpt":
        paths = train_tokenizer([], work, "bpe", vocab_size, texts=iter(texts))
        tok = build_tokenizer("GPT2BPETokenizer", **paths)
        docs = [[text] for text in texts]
    else:
        # Source lines stand in for sentences, and each function or class definition is a document.
        # With whole files as documents, a sample is a window from the middle of a long file, and the
        # order of its two halves (the sentence-order task) has almost nothing to go on: a bag-of-tokens
        # probe scores 53% on it against 73% on definitions, whose opening line, docstring and
        # returns fix the order. WordPiece drops whitespace, so each line keeps its indentation
        # depth as leading marks.
        docs = [[_with_indent(line) for line in block]
                for text in texts for block in definition_blocks(text)]
        paths = train_tokenizer([], work, "wordpiece", vocab_size, lower_case=True,
                                texts=(line for d in docs for line in d))
        tok = build_tokenizer("BertWordPieceLowerCase", **paths)
    _log(f"tokenizer trained in {time.perf_counter() - t0:.1f}s; tokenizing")
    builder = IndexedDatasetBuilder(os.path.join(work, "corpus"), best_dtype(tok.vocab_size))
    # One encode_batch over everything: it runs on all cores inside the tokenizers library.
    flat = tok.tokenize_batch([s for doc in docs for s in doc])
    pos = 0
    for doc in docs:
        ids = [s for s in flat[pos:pos + len(doc)] if s]
        pos += len(doc)
        if not ids:
            continue
        if kind == "gpt":
            ids[-1].append(tok.eod)
        for s in ids:
            builder.add_item(s)
        builder.end_document()
    builder.finalize()
    root = os.path.dirname(sysconfig.get_paths()["stdlib"])
    meta = {"kind": kind, "vocab_size": vocab_size, "python": sys.version,
            "files": [os.path.relpath(p, root) for p in files], "stdlib_root": root,
            "tokenizer_type": "GPT2BPETokenizer" if kind == "gpt" else "BertWordPieceLowerCase",
            "tokenizer_files": {k: os.path.basename(v) for k, v in paths.items()}}
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    _log(f"built in {time.perf_counter() - t0:.1f}s")


VOCAB_SIZE = 4096  # the bundled corpus's tokenizer's vocabulary, as asked of the trainer


def default_corpus_dir(cache_dir: str | None = None, kind: str = "gpt", vocab_size: int = VOCAB_SIZE,
                       max_bytes: int = 8_000_000) -> str:
    """The cache folder `default_corpus` uses for these settings."""
    base = cache_dir or os.environ.get("JAX3D_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jax3d", "default_corpus")
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(base, f"{py}_{kind}_v{vocab_size}_{max_bytes // 1000}kB_r{_BUILD_VERSION}")


def tokenizer_files(cache_dir: str | None = None, kind: str = "gpt") -> dict:
    """The cached corpus's tokenizer files ({"vocab_file": path, ...}), as `default_corpus` builds them; {}
    when that cache is not built."""
    d = default_corpus_dir(cache_dir, kind=kind)
    try:
        with open(os.path.join(d, "meta.json")) as f:
            return {k: os.path.join(d, v) for k, v in json.load(f)["tokenizer_files"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def default_corpus(cache_dir: str | None = None, vocab_size: int = VOCAB_SIZE, kind: str = "gpt",
                   max_bytes: int = 8_000_000):
    """Return `(data_prefix, tokenizer)` for the stdlib-source corpus, building it on first use.

    kind="gpt": one document per file with EOD appended, byte-level BPE (`GPT2BPETokenizer`).
    kind="bert": one document per function or class definition (`definition_blocks`), one source
    line per sentence with its indentation depth kept as leading `§` marks; lower-cased WordPiece
    with [CLS] [SEP] [MASK] [PAD] [UNK].
    Cached under `cache_dir`, else `$JAX3D_CACHE`, else `~/.cache/jax3d/default_corpus`, keyed by
    Python version, kind, vocabulary size, `max_bytes` and the build's version (`default_corpus_dir`). The build happens in a temporary folder that is
    renamed into place, so an interrupted build leaves nothing that looks finished.
    """
    if kind not in ("gpt", "bert"):
        raise ValueError(f"default_corpus kind {kind!r} is not one of 'gpt', 'bert'.")
    final = default_corpus_dir(cache_dir, kind, vocab_size, max_bytes)
    if not os.path.exists(os.path.join(final, "meta.json")):
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".building-", dir=parent)
        os.chmod(work, 0o755)  # mkdtemp makes it private; the cache may be shared by users
        try:
            _build(work, kind, vocab_size, max_bytes)
            try:
                os.rename(work, final)
            except OSError:
                # Another process finished first (rename onto a non-empty dir fails); use theirs.
                if not os.path.exists(os.path.join(final, "meta.json")):
                    raise
        finally:
            if os.path.exists(work):
                shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(final, "meta.json")) as f:
        meta = json.load(f)
    files = {k: os.path.join(final, v) for k, v in meta["tokenizer_files"].items()}
    prefix = os.path.join(final, "corpus")
    assert dataset_exists(prefix), f"{final} is missing corpus.bin/.idx; delete the folder to rebuild"
    return prefix, build_tokenizer(meta["tokenizer_type"], **files)


if __name__ == "__main__":
    for k in ("gpt", "bert"):
        p, t = default_corpus(kind=k)
        ds = IndexedDataset(p)
        print(k, p, f"{len(ds)} sequences, {ds.num_documents} documents, {ds.tokens.size} tokens, "
              f"vocab {t.vocab_size}")
