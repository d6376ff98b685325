"""Our Megatron-named tokenizers against HF's reference tokenizer classes on the same files."""
import json
import os
import subprocess
import sys

import pytest
from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer, Tokenizer

from jax3d.data import DataError, build_tokenizer, train_tokenizer
from jax3d.data.synthetic import synthetic_documents
from tests.helpers import ROOT

TEXTS = synthetic_documents(800, seed=7) + ["Ünïcödé façade, naïve café. Tabs\tand  spaces!"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tok") / "corpus.txt"
    p.write_text("\n".join(TEXTS), encoding="utf-8")
    return p


def test_gpt2_bpe_matches_hf_reference(corpus_file, tmp_path):
    files = train_tokenizer([str(corpus_file)], str(tmp_path), "bpe", vocab_size=500)
    ours = build_tokenizer("GPT2BPETokenizer", **files)
    ref = ByteLevelBPETokenizer(files["vocab_file"], files["merge_file"])
    assert ours.vocab_size == ref.get_vocab_size()
    for t in TEXTS[:50] + TEXTS[-1:]:
        assert ours.tokenize(t) == ref.encode(t).ids
        assert ours.detokenize(ours.tokenize(t)) == t  # byte-level BPE is lossless
    assert ours.eod == ref.token_to_id("<|endoftext|>")
    assert ours.tokenize("a<|endoftext|>b").count(ours.eod) == 1


@pytest.mark.parametrize("name,lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_matches_hf_reference(corpus_file, tmp_path, name, lower):
    files = train_tokenizer([str(corpus_file)], str(tmp_path), "wordpiece", vocab_size=400,
                            lower_case=lower)
    ours = build_tokenizer(name, **files)
    ref = BertWordPieceTokenizer(files["vocab_file"], lowercase=lower, strip_accents=None)
    for t in TEXTS[:50] + TEXTS[-1:]:
        assert ours.tokenize(t) == ref.encode(t, add_special_tokens=False).ids
    for attr, tok in (("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"), ("pad", "[PAD]")):
        assert getattr(ours, attr) == ref.token_to_id(tok)
    assert ours.tokenize("[MASK]") == [ours.mask]


def test_hf_tokenizer_json(corpus_file, tmp_path):
    files = train_tokenizer([str(corpus_file)], str(tmp_path), "bpe", vocab_size=500)
    ref = ByteLevelBPETokenizer(files["vocab_file"], files["merge_file"])
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("HFTokenizer", tokenizer_file=str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.tokenize(TEXTS[3]) == loaded.encode(TEXTS[3]).ids
    assert ours.eod == loaded.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("end", ["<|end_of_text|>", "</s>", "<eos>"])
def test_hf_tokenizer_json_end_of_text(corpus_file, tmp_path, end):
    """A tokenizer.json whose documents end with Llama 3's, Llama 2's or Gemma's token: that token is `eod`, not
    the beginning-of-text token added beside it."""
    from tokenizers import models, pre_tokenizers, trainers

    ref = Tokenizer(models.BPE())
    ref.pre_tokenizer = pre_tokenizers.ByteLevel()
    ref.train([str(corpus_file)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", end]))
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("HFTokenizer", tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert ours.eod == ref.token_to_id(end) != ref.token_to_id("<|begin_of_text|>")


def test_errors_name_the_flag(tmp_path):
    with pytest.raises(DataError, match="--tokenizer-type Nope is not supported"):
        build_tokenizer("Nope")
    with pytest.raises(DataError, match="--merge-file is required"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path))
    with pytest.raises(DataError, match="--vocab-file .*missing.txt does not exist"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "missing.txt"))
    (tmp_path / "vocab.json").write_text("not JSON")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(DataError, match="vocab.json and .*merges.txt could not be read as GPT2BPETokenizer"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    from jax3d.data.tokenizers import train_tokenizer
    with pytest.raises(DataError, match="--min-frequency -1 must not be negative"):  # was an OverflowError
        train_tokenizer([], str(tmp_path / "tok"), "bpe", 300, min_frequency=-1, texts=iter(["a b"]))


def test_bert_data_refuses_a_tokenizer_without_its_special_tokens(corpus_file, tmp_path):
    """A GPT-2 BPE has no [CLS] / [SEP] / [MASK] / [PAD]: BERT data refuses it in one sentence (it raised
    AttributeError)."""
    from jax3d.data.bert_dataset import BertTokenIds
    from jax3d.data.tokenizers import train_tokenizer

    files = train_tokenizer([str(corpus_file)], str(tmp_path / "bpe"), "bpe", 500)
    gpt2 = build_tokenizer("GPT2BPETokenizer", **files)
    with pytest.raises(DataError, match="has no \\[CLS\\], \\[SEP\\], \\[MASK\\], \\[PAD\\]; use --tokenizer-type BertWordPiece"):
        BertTokenIds.from_tokenizer(gpt2)


def test_train_tokenizer_cli(corpus_file, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cli = [sys.executable, os.path.join(ROOT, "launch/train_tokenizer.py")]
    r = subprocess.run(cli + ["--type", "wordpiece", "--vocab-size", "300", "--output-dir",
                              str(tmp_path), str(corpus_file)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(tmp_path / "vocab.txt"))
    assert tok.vocab_size <= 300 and tok.cls is not None
    r = subprocess.run(cli + ["--min-frequency", "100000000", "--vocab-size", "500", "--output-dir",
                              str(tmp_path / "rare"), str(corpus_file)], capture_output=True, text=True, env=env)
    learned = len(json.loads((tmp_path / "rare" / "vocab.json").read_text()))
    assert r.returncode == 0 and f"the vocabulary has {learned} tokens, fewer than --vocab-size 500" in r.stderr
    r = subprocess.run(cli + ["--output-dir", str(tmp_path / "new"), str(tmp_path / "nope.txt")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope.txt does not exist" in r.stderr  # 1 before
    vocab = (tmp_path / "vocab.txt").read_bytes()
    r = subprocess.run(cli + ["--type", "wordpiece", "--vocab-size", "300", "--output-dir", str(tmp_path),
                              str(corpus_file)], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "already holds vocab.txt" in r.stderr
    assert (tmp_path / "vocab.txt").read_bytes() == vocab  # data built with it needs it unchanged
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "binary.bin").write_bytes(bytes(range(128, 256)) * 8)
    for args, words in ((["--vocab-size", "0", str(corpus_file)], "--vocab-size 0 leaves no room"),
                        ([str(tmp_path / "blank.txt")], "hold no text"),
                        ([str(tmp_path / "binary.bin")], "could not be read as text"),
                        ([str(tmp_path)], "is not a file")):
        r = subprocess.run(cli + ["--output-dir", str(tmp_path / "new"), *args], capture_output=True, text=True,
                           env=env)
        assert r.returncode != 0 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
        assert not (tmp_path / "new").exists()  # a refused run leaves no folder behind


def test_jsonl_corpus_learns_what_its_plain_text_does(corpus_file, tmp_path):
    """A .jsonl corpus (preprocess_data.py's format) teaches the tokenizer its text field, as the same text in a
    plain file does: the same vocabulary and merges, and no piece of JSON syntax (before, it learned `{"`, `":`
    and escapes such as `:\\` from the raw lines)."""
    lines = corpus_file.read_text(encoding="utf-8").splitlines(keepends=True)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": line}) + "\n" for i, line in enumerate(lines)),
                     encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=ROOT)
    cli = [sys.executable, os.path.join(ROOT, "launch/train_tokenizer.py"), "--vocab-size", "600"]
    for name, src in (("plain", corpus_file), ("jsonl", jsonl)):
        r = subprocess.run(cli + ["--output-dir", str(tmp_path / name), str(src)], capture_output=True, text=True,
                           env=env)
        assert r.returncode == 0, r.stderr
    for f in ("vocab.json", "merges.txt"):
        assert (tmp_path / "jsonl" / f).read_text() == (tmp_path / "plain" / f).read_text(), f
    learned = [p for p in json.loads((tmp_path / "jsonl" / "vocab.json").read_text()) if len(p) > 1]
    assert not [p for p in learned if '"' in p or "\\" in p]
    # Bad lines fail or are skipped as preprocess_data.py's are, and a missing field is named.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\nnot json\n', encoding="utf-8")
    for args, words in (([str(bad)], "bad.jsonl line 2: invalid JSON"),
                        ([str(jsonl), "--json-keys", "body"], "line 1: no string field 'body'"),
                        ([str(jsonl), "--on-bad-line", "skip", "--json-keys", "body"], "hold no text under --json-keys body"),
                        # --json-keys before the inputs: the words that name files are the inputs
                        (["--json-keys", "body", str(jsonl)], "line 1: no string field 'body'"),
                        (["--json-keys", "body", str(tmp_path / "gone.jsonl")],
                         f"--json-keys took body {tmp_path / 'gone.jsonl'}, and none of those names a file"),
                        (["--json-keys", str(jsonl)], "names input files but no key")):
        r = subprocess.run(cli + ["--output-dir", str(tmp_path / "new"), *args], capture_output=True, text=True, env=env)
        assert r.returncode != 0 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
        assert not (tmp_path / "new").exists()
    r = subprocess.run(cli + ["--output-dir", str(tmp_path / "before"), "--json-keys", "text", str(jsonl)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and (tmp_path / "before" / "merges.txt").read_text() == \
        (tmp_path / "jsonl" / "merges.txt").read_text(), r.stderr
    r = subprocess.run(cli + ["--output-dir", str(tmp_path / "skip"), "--on-bad-line", "skip", str(bad)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "bad.jsonl line 2: invalid JSON" in r.stderr and "skipped" in r.stderr, r.stderr
