"""JSONL preprocessing against direct tokenization; worker count must not change the bytes."""
import os
import subprocess
import sys

import numpy as np
import pytest

from jax3d.data import (DataError, IndexedDataset, TokenizerSpec, preprocess_jsonl, split_sentences,
                        train_tokenizer)
from jax3d.data.synthetic import synthetic_documents, write_jsonl
from tests.helpers import ROOT

N_DOCS = 10_000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    docs = synthetic_documents(N_DOCS, seed=1)
    files = train_tokenizer([], str(d), "bpe", vocab_size=400, texts=iter(docs[:2000]))
    write_jsonl(str(d / "in.jsonl"), docs)
    return d, docs, TokenizerSpec("GPT2BPETokenizer", **files)


def test_preprocess_round_trip_and_workers_byte_identical(corpus):
    d, docs, spec = corpus
    tok = spec.build()
    rates = {}
    for w in (1, 2):
        s = preprocess_jsonl(str(d / "in.jsonl"), str(d / f"w{w}"), spec, append_eod=True,
                             workers=w, progress=False)
        assert s.documents == N_DOCS and s.skipped_lines == 0
        rates[w] = s.docs_per_second
    print(f"\npreprocess docs/s: 1 worker {rates[1]:.0f}, 2 workers {rates[2]:.0f}")
    for ext in (".bin", ".idx"):
        assert (open(d / f"w1_text_document{ext}", "rb").read()
                == open(d / f"w2_text_document{ext}", "rb").read())
    ds = IndexedDataset(str(d / "w2_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == N_DOCS
    np.testing.assert_array_equal(ds.doc_idx, np.arange(N_DOCS + 1))
    for i in range(0, N_DOCS, 97):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]
    assert tok.detokenize(ds[5][:-1]) == docs[5]


def test_split_sentences_output(corpus):
    d, docs, spec = corpus
    tok = spec.build()
    lines = d / "small.jsonl"
    write_jsonl(str(lines), docs[:50])
    s = preprocess_jsonl(str(lines), str(d / "sent"), spec, split_sentences_=True, progress=False)
    ds = IndexedDataset(s.outputs[0])
    assert s.outputs[0].endswith("sent_text_sentence")
    expect = [tok.tokenize(x) for doc in docs[:50] for x in split_sentences(doc)]
    assert [ds[i].tolist() for i in range(len(ds))] == expect
    per_doc = [len(split_sentences(doc)) for doc in docs[:50]]
    np.testing.assert_array_equal(ds.doc_idx, np.cumsum([0] + per_doc))
    assert split_sentences("One two. Three four! five. Six") == ["One two.", "Three four! five.", "Six"]


def _bad_file(d):
    p = d / "bad.jsonl"
    p.write_text('{"text": "Hello world."}\n{"text": "oops"\n[1, 2]\n{"text": "Fine again."}\n')
    return p


def test_bad_line_skip_reports_line_numbers(corpus, capsys):
    d, _, spec = corpus
    s = preprocess_jsonl(str(_bad_file(d)), str(d / "skip"), spec, on_bad_line="skip", progress=False)
    err = capsys.readouterr().err
    assert "line 2: invalid JSON" in err and "line 3: expected a JSON object" in err
    assert s.documents == 2 and s.skipped_lines == 2
    assert len(IndexedDataset(s.outputs[0])) == 2


def test_bad_line_fail_mode(corpus):
    d, _, spec = corpus
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        preprocess_jsonl(str(_bad_file(d)), str(d / "fail"), spec, progress=False)
    assert not os.path.exists(d / "fail_text_document.bin")  # no half-written output


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch/preprocess_data.py"), *args],
                          capture_output=True, text=True, env=env)


def test_cli_one_sentence_errors(corpus):
    d, _, spec = corpus
    # The output folder does not exist yet: preprocessing creates it, as the README's command expects.
    common = ["--output-prefix", str(d / "new" / "cli"), "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", spec.vocab_file, "--merge-file", spec.merge_file, "--no-progress"]
    r = _cli("--input", str(_bad_file(d)), *common)
    assert r.returncode == 2 and "Traceback" not in r.stderr  # bad input exits 2, as every jax3d command
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "line 2: invalid JSON" in r.stderr
    assert not (d / "new").exists()  # the failed run left its new output folder behind
    r = _cli("--input", str(_bad_file(d)), *common, "--on-bad-line", "skip")
    assert r.returncode == 0 and "line 3" in r.stderr and "2 bad lines skipped" in r.stderr
    assert os.path.exists(d / "new" / "cli_text_document.idx")
    before = (d / "new" / "cli_text_document.bin").read_bytes()
    r = _cli("--input", str(d / "in.jsonl"), *common)  # the same prefix again: refused, the data kept
    assert r.returncode != 0 and "cli_text_document.bin and " in r.stderr
    assert "cli_text_document.idx already exist;" in r.stderr
    assert (d / "new" / "cli_text_document.bin").read_bytes() == before
    (d / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    blank_prefix = [a if a != str(d / "new" / "cli") else str(d / "blank") for a in common]
    r = _cli("--input", str(d / "blank.jsonl"), *blank_prefix)
    assert r.returncode != 0 and "holds no document with text" in r.stderr
    assert not os.path.exists(str(d / "blank_text_document.bin"))
    r = _cli("--input", str(d / "missing.jsonl"), *common)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "missing.jsonl does not exist" in r.stderr
    bad_vocab = [a if a != spec.vocab_file else str(d / "nope.json") for a in common]
    r = _cli("--input", str(_bad_file(d)), *bad_vocab)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--vocab-file" in r.stderr
    for extra, words in ((["--chunk-lines", "-5"], "--chunk-lines -5 must be at least 1"),
                         (["--output-prefix", str(d / "folder") + os.sep], "names a folder; add a file name prefix"),
                         (["--output-prefix", "/sys/jax3d/corpus"], "its folder cannot be written")):
        r = _cli("--input", str(d / "in.jsonl"), *common, *extra)
        assert r.returncode != 0 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
    for keys in ([""], ["text", "text"]):
        r = _cli("--input", str(d / "in.jsonl"), *blank_prefix, "--json-keys", *keys)
        assert r.returncode != 0 and "Traceback" not in r.stderr and "empty or repeated key" in r.stderr
