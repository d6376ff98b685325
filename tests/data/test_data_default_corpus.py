"""The stdlib-source default corpus: built once, equal to direct tokenization, then cached."""
import json
import os
import time

import numpy as np

from jax3d.data import IndexedDataset
from jax3d.data.default_corpus import (default_corpus, default_corpus_dir, definition_blocks,
                                       stdlib_files)


def _meta_files(prefix):
    meta = json.load(open(os.path.join(os.path.dirname(prefix), "meta.json")))
    return [os.path.join(meta["stdlib_root"], f) for f in meta["files"]]


def test_gpt_corpus_round_trip_and_cache(tmp_path, capfd):
    prefix, tok = default_corpus(cache_dir=str(tmp_path), vocab_size=4096)
    assert "built in" in capfd.readouterr().err
    ds = IndexedDataset(prefix)
    files = _meta_files(prefix)
    assert files == stdlib_files()
    assert not any("site-packages" in f or "/test/" in f for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 8_000_000
    assert tok.vocab_size == 4096 and ds.dtype == np.uint16
    assert len(ds) == ds.num_documents == len(files)
    for i in (0, len(files) // 2, len(files) - 1):
        text = open(files[i], encoding="utf-8", errors="replace").read()
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    assert tok.detokenize(ds[0][:-1]) == open(files[0], encoding="utf-8").read()
    # Second call: from cache, no rebuild, same files.
    t0 = time.perf_counter()
    prefix2, tok2 = default_corpus(cache_dir=str(tmp_path), vocab_size=4096)
    assert time.perf_counter() - t0 < 2.0 and prefix2 == prefix
    assert "built" not in capfd.readouterr().err
    assert tok2.tokenize("def f(x): return x") == tok.tokenize("def f(x): return x")
    # Nothing half-built is left next to the finished cache.
    assert os.listdir(tmp_path) == [os.path.basename(os.path.dirname(prefix))]


def test_bert_corpus_documents_are_definitions_of_indented_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX3D_CACHE", str(tmp_path))
    prefix, tok = default_corpus(vocab_size=2000, kind="bert", max_bytes=300_000)
    assert prefix.startswith(default_corpus_dir(None, "bert", 2000, 300_000))
    assert all(x is not None for x in (tok.cls, tok.sep, tok.mask, tok.pad))
    ds = IndexedDataset(prefix)
    files = _meta_files(prefix)
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in files]
    # each line carries one leading mark per indentation level of four columns
    def marked(l):
        return "§ " * ((len(l.expandtabs(4)) - len(l.lstrip(" \t").expandtabs(4))) // 4) + l.lstrip(" \t")
    expect = [[ids for ids in (tok.tokenize(marked(l)) for l in block) if ids]
              for text in texts for block in definition_blocks(text)]
    expect = [d for d in expect if d]
    assert ds.num_documents == len(expect) > 2 * len(files)
    for d in (0, 1, len(expect) // 2, len(expect) - 1):
        got = [ds[j].tolist() for j in range(ds.doc_idx[d], ds.doc_idx[d + 1])]
        assert got == expect[d]


def test_definition_blocks_keep_every_line_in_order():
    src = """\"\"\"Module docstring.\"\"\"
import os


@decorator
@other(1)
def f(x):
    return x

class C:
    y = 1

    def g(self):
        pass
    async def h(self):
        await z
"""
    blocks = definition_blocks(src)
    assert [b[0].strip() for b in blocks] == ['"""Module docstring."""', "@decorator", "class C:",
                                              "def g(self):", "async def h(self):"]
    assert blocks[1] == ["@decorator", "@other(1)", "def f(x):", "    return x"]
    assert [l for b in blocks for l in b] == [l for l in src.splitlines() if l.strip()]
    assert definition_blocks("") == []
    assert definition_blocks("def f():\n    pass\n") == [["def f():", "    pass"]]


def test_package_name_is_the_function():
    import jax3d.data
    import jax3d.data.default_corpus  # noqa: F401  (importing the submodule must not shadow it)
    assert callable(jax3d.data.default_corpus)
    from jax3d.data import default_corpus as fn
    assert fn is default_corpus
