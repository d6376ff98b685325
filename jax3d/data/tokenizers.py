"""Tokenizers by Megatron's names, backed by HF `tokenizers` (SentencePiece models by `sentencepiece`), plus
training small vocabularies.

Every tokenizer exposes `vocab_size`, `tokenize(text) -> list[int]`, `detokenize(ids)`, `eod`;
the BERT ones also `cls`, `sep`, `mask`, `pad`.
"""
from __future__ import annotations

import os
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jax3d.file_util import dir_problem
from jax3d.data import jsonl
from jax3d.data.indexed import DataError

GPT2_EOD = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "HFTokenizer",
                   "GPTSentencePieceTokenizer")


def _need_file(path, flag, hint="pass an existing file or train one with launch/train_tokenizer.py"):
    if not path:
        raise DataError(f"{flag} is required for this tokenizer type; pass it too.")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path} does not exist; {hint}.")
    return path


def _has_text(path: str) -> bool:
    """Whether the file holds anything but whitespace (read until the first such byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


class _HFBacked:
    """Shared interface over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _id(self, token):
        return self.tok.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)


class GPT2BPETokenizer(_HFBacked):
    """Byte-level BPE from GPT-2's `vocab.json` + `merges.txt`; `eod` is `<|endoftext|>`."""

    def __init__(self, vocab_file: str, merge_file: str):
        model = models.BPE.from_file(vocab_file, merge_file)
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        super().__init__(tok)
        if self._id(GPT2_EOD) is None:
            raise DataError(f"{vocab_file} has no {GPT2_EOD} token; GPT-2 vocabularies need it as "
                            "end-of-document, retrain with launch/train_tokenizer.py.")
        tok.add_special_tokens([GPT2_EOD])
        self.eod = self._id(GPT2_EOD)


class _BertWordPiece(_HFBacked):
    lower_case = True

    def __init__(self, vocab_file: str):
        tok = Tokenizer(models.WordPiece.from_file(vocab_file, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=self.lower_case, strip_accents=None,
                                                    clean_text=True, handle_chinese_chars=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        super().__init__(tok)
        missing = [t for t in BERT_SPECIALS if self._id(t) is None]
        if missing:
            raise DataError(f"{vocab_file} lacks BERT special tokens {missing}; use a BERT vocab.txt "
                            "or train one with launch/train_tokenizer.py --type wordpiece.")
        tok.add_special_tokens(BERT_SPECIALS)
        self.cls, self.sep, self.mask, self.pad, self.unk = (
            self._id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"))
        # Megatron's BERT tokenizers have no end-of-document token; documents are separated by index.
        self.eod = self.sep


class BertWordPieceLowerCase(_BertWordPiece):
    """BERT WordPiece from `vocab.txt`, lower-casing input."""
    lower_case = True


class BertWordPieceCase(_BertWordPiece):
    """BERT WordPiece from `vocab.txt`, case preserved."""
    lower_case = False


class HFTokenizer(_HFBacked):
    """Any HF `tokenizer.json`; `eod` is the first of the usual end-of-text tokens it has (GPT-2's, Llama 3's,
    then SentencePiece-style ones)."""

    def __init__(self, tokenizer_file: str):
        super().__init__(Tokenizer.from_file(tokenizer_file))
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.eod = next((vocab[t] for t in (GPT2_EOD, "<|end_of_text|>", "</s>", "<eos>", "[SEP]") if t in vocab), None)
        for name, t in (("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"), ("pad", "[PAD]")):
            setattr(self, name, vocab.get(t))


class GPTSentencePieceTokenizer:
    """A SentencePiece model (Llama's `tokenizer.model`) as Megatron's GPTSentencePieceTokenizer reads it: ids
    are the model's pieces, nothing added; `eod` is its end-of-sentence id."""

    def __init__(self, tokenizer_model: str):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise DataError(f"--tokenizer-model {tokenizer_model} has no end-of-sentence piece, which GPT "
                            "documents end with; train it with one (sentencepiece's eos_id)")
        # -1 where the model has no such piece
        self.pad, self.bos, self.unk = self.sp.pad_id(), self.sp.bos_id(), self.sp.unk_id()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None  # an unknown piece reads as the unk id

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode_as_ids(texts)

    def detokenize(self, ids) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


def default_tokenizer_type(model_type: str, vocab_file: str = "", merge_file: str = "", tokenizer_file: str = "",
                           tokenizer_model: str = "") -> str:
    """The `--tokenizer-type` a run with these tokenizer files and no type reads them as: with a vocabulary
    file Megatron's per-script default, pretrain_gpt.py's GPT2BPETokenizer for a GPT (Llama included) and
    pretrain_bert.py's BertWordPieceLowerCase for a BERT; a lone SentencePiece model or tokenizer.json is the
    one type that reads it. "" without files."""
    if vocab_file or merge_file:
        return "BertWordPieceLowerCase" if model_type == "bert" else "GPT2BPETokenizer"
    if tokenizer_model:
        return "GPTSentencePieceTokenizer"
    return "HFTokenizer" if tokenizer_file else ""


def build_tokenizer(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_file: str | None = None, tokenizer_model: str | None = None):
    """Build a tokenizer by Megatron's `--tokenizer-type` name from its vocabulary files."""
    try:
        return _build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_file, tokenizer_model)
    except (DataError, OSError):
        raise
    except Exception as e:  # tokenizers and sentencepiece raise plain Exceptions for files they cannot parse
        files = " and ".join(f for f in (vocab_file, merge_file, tokenizer_file, tokenizer_model) if f)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{files} could not be read as {tokenizer_type} files ({reason}); pass the files "
                        "of that tokenizer type or train them with launch/train_tokenizer.py.") from None


def _build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_file, tokenizer_model):
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_need_file(vocab_file, "--vocab-file"),
                                _need_file(merge_file, "--merge-file"))
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceLowerCase(_need_file(vocab_file, "--vocab-file"))
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceCase(_need_file(vocab_file, "--vocab-file"))
    if tokenizer_type == "HFTokenizer":
        return HFTokenizer(_need_file(tokenizer_file, "--tokenizer-file"))
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_need_file(tokenizer_model, "--tokenizer-model",
                                                    "pass an existing SentencePiece model (tokenizer.model)"))
    raise DataError(f"--tokenizer-type {tokenizer_type} is not supported; choose one of "
                    f"{', '.join(TOKENIZER_TYPES)}.")


def train_tokenizer(files: list[str], out_dir: str, kind: str = "bpe", vocab_size: int = 4096,
                    lower_case: bool = True, min_frequency: int = 2, texts=None, json_keys=("text",),
                    on_bad_line: str = "fail") -> dict:
    """Train a byte-level BPE (`vocab.json` + `merges.txt`) or WordPiece (`vocab.txt`) on local text.

    Files named `.json` or `.jsonl` are loose-JSON corpora, read as preprocess_data.py reads them: the
    strings under `json_keys` of each line's object, a bad line failing or skipped by `on_bad_line`.
    Other files are plain text. `texts`, if given, is an iterator of strings used instead of `files`.
    Returns the written paths, keyed by the matching `build_tokenizer` argument names.
    """
    smallest = {"bpe": 258, "wordpiece": len(BERT_SPECIALS) + 1}.get(kind, 0)
    if vocab_size < smallest:
        raise DataError(f"--vocab-size {vocab_size} leaves no room for learned tokens; a {kind} vocabulary needs "
                        f"at least {smallest} ({smallest - 1} are fixed), e.g. 32000.")
    if min_frequency < 0:
        raise DataError(f"--min-frequency {min_frequency} must not be negative")
    problem = dir_problem(out_dir)
    if problem:
        raise DataError(f"--output-dir {out_dir} {problem}; pass a directory.")
    written = ("vocab.json", "merges.txt") if kind == "bpe" else ("vocab.txt",)
    taken = [f for f in written if os.path.exists(os.path.join(out_dir, f))]
    if taken:  # data preprocessed with that vocabulary needs it unchanged
        raise DataError(f"--output-dir {out_dir} already holds {' and '.join(taken)}; pass a new directory")
    json_inputs = texts is None and any(jsonl.is_json_lines(f) for f in files)
    if texts is None:
        for f in files:
            _need_file(f, "input", "pass existing plain-text files")
            if not os.path.isfile(f):
                raise DataError(f"input {f} is not a file; pass plain-text files.")
        if not any(_has_text(f) for f in files):
            raise DataError(f"the input files ({', '.join(files)}) hold no text; pass files with text to learn from.")
    if json_inputs:
        json_keys = jsonl.checked_options(json_keys, on_bad_line)
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=[GPT2_EOD], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=None)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=BERT_SPECIALS, show_progress=False)
    else:
        raise DataError(f"--type {kind} is not a tokenizer kind; choose bpe or wordpiece.")
    if texts is not None:
        tok.train_from_iterator(texts, trainer)
    else:
        try:
            if json_inputs:
                tok.train_from_iterator(_file_texts(files, json_keys, on_bad_line), trainer)
            else:
                tok.train(files, trainer)
        except DataError:
            raise
        except Exception as e:  # the tokenizers library raises plain Exceptions, e.g. for binary input
            raise DataError(f"the input files ({', '.join(files)}) could not be read as text ({e}); pass "
                            "UTF-8 plain-text files.") from None
    learned = tok.get_vocab_size()
    if learned < vocab_size:  # the text (or --min-frequency) allowed no more
        print(f"jax3d: the vocabulary has {learned} tokens, fewer than --vocab-size {vocab_size}: the text has no "
              f"more pieces seen at least --min-frequency {min_frequency} times", file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)  # after training: a failed run leaves no empty folder
    if kind == "bpe":
        vocab, merges = tok.model.save(out_dir)
        return {"vocab_file": vocab, "merge_file": merges}
    (vocab,) = tok.model.save(out_dir)
    return {"vocab_file": vocab}


def _file_texts(files: list[str], json_keys, on_bad_line: str):
    """The strings of `files` that `train_tokenizer` learns from: a loose-JSON file's fields, a plain
    file's lines (as the tokenizers library reads a plain file, so a plain file learns the same here)."""
    learned = False
    for f in files:
        if jsonl.is_json_lines(f):
            for text in jsonl.texts(f, json_keys, on_bad_line):
                learned = learned or bool(text.strip())
                yield text
        else:
            with open(f, encoding="utf-8") as lines:
                for line in lines:
                    learned = learned or bool(line.strip())
                    yield line
    if not learned:
        raise DataError(f"the input files ({', '.join(files)}) hold no text under --json-keys {' '.join(json_keys)}; "
                        "pass the JSON field that holds the text.")
