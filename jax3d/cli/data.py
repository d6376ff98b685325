"""The command lines of `launch/preprocess_data.py` (Megatron's flag names) and `launch/train_tokenizer.py`."""
from __future__ import annotations

import os
import sys

from jax3d.cli.common import ExampleHelpFormatter, OneLineParser, run_command
from jax3d.data.indexed import DataError
from jax3d.data.tokenizers import TOKENIZER_TYPES

_BAD_LINE = "a line that is not a JSON object with those keys: fail stops with its line number, skip counts it and goes on"


def _bad_input():
    return DataError, OSError


def preprocess_parser() -> OneLineParser:
    p = OneLineParser(prog="launch/preprocess_data.py", formatter_class=ExampleHelpFormatter, description="""\
Tokenize a loose-JSON corpus (one JSON object a line) into Megatron .bin/.idx files, one pair per
--json-keys key: PREFIX_KEY_document (PREFIX_KEY_sentence with --split-sentences).

    python launch/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2""")
    p.add_argument("--input", required=True, help="the corpus, one JSON object a line (Megatron's loose JSON, e.g. corpus.jsonl)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="string fields of each object to tokenize, each into its own .bin/.idx")
    p.add_argument("--output-prefix", required=True, help="path and file-name start of the outputs, e.g. data/corpus")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                   help="GPT2BPETokenizer: byte-level BPE (--vocab-file vocab.json, --merge-file merges.txt); "
                        "BertWordPieceLowerCase / BertWordPieceCase: WordPiece (--vocab-file vocab.txt); "
                        "HFTokenizer: any Hugging Face tokenizer.json (--tokenizer-file); GPTSentencePieceTokenizer: "
                        "a SentencePiece model such as Llama's tokenizer.model (--tokenizer-model)")
    p.add_argument("--vocab-file", help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*) "
                   "(default: none; those types need it)")
    p.add_argument("--merge-file", help="merges.txt of a GPT2BPETokenizer (default: none; that type needs it)")
    p.add_argument("--tokenizer-file", help="tokenizer.json of an HFTokenizer (default: none; that type needs it)")
    p.add_argument("--tokenizer-model", help="SentencePiece model of a GPTSentencePieceTokenizer (default: none; that "
                   "type needs it)")
    p.add_argument("--append-eod", action="store_true",
                   help="end each document with the end-of-document token (GPT training needs it)")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence, as BERT's sentence-order task reads them")
    p.add_argument("--workers", type=int, default=1, help="processes that tokenize in parallel (the output is "
                   "the same for any number)")
    p.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail", help=_BAD_LINE)
    p.add_argument("--dataset-impl", choices=("mmap",), default="mmap",
                   help="accepted for Megatron scripts; mmap is the only format written")
    p.add_argument("--chunk-lines", type=int, default=256, help="lines per worker task")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (batch jobs)")
    return p


def preprocess_main(argv=None) -> int:
    """`launch/preprocess_data.py`: one summary line on stderr; bad input is one sentence and exit 2."""
    return run_command(_preprocess, argv, _bad_input)


def _preprocess(argv) -> int:
    from jax3d.data.preprocess import TokenizerSpec, preprocess_jsonl

    args = preprocess_parser().parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_file,
                         args.tokenizer_model)
    new_dirs = []  # the output folders this run would create, deepest first
    d = os.path.dirname(os.path.abspath(args.output_prefix))
    while not os.path.exists(d):
        new_dirs.append(d)
        d = os.path.dirname(d)
    try:
        s = preprocess_jsonl(args.input, args.output_prefix, spec, args.json_keys, args.append_eod,
                             args.split_sentences, args.workers, args.on_bad_line, args.chunk_lines,
                             progress=not args.no_progress)
    except BaseException:
        for d in new_dirs:  # a failed run leaves no empty folders behind
            if os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)
        raise
    print(f"{s.documents} documents, {s.tokens} tokens, {s.skipped_lines} bad lines skipped, "
          f"{s.empty_documents} empty documents left out, {s.docs_per_second:.0f} docs/s; wrote "
          + ", ".join(p + ".bin/.idx" for p in s.outputs), file=sys.stderr)
    return 0


def train_tokenizer_parser() -> OneLineParser:
    p = OneLineParser(prog="launch/train_tokenizer.py", formatter_class=ExampleHelpFormatter, description="""\
Train a byte-level BPE (vocab.json + merges.txt) or WordPiece (vocab.txt) on local text files
(plain text, or the .json/.jsonl corpora preprocess_data.py reads).

    python launch/train_tokenizer.py --type bpe --vocab-size 32000 --output-dir tok/ corpus/*.txt""")
    # "*", not "+": a missing input gets its own message in _train_tokenizer
    p.add_argument("inputs", nargs="*", help="plain-text files, or .json/.jsonl corpora (one JSON object a line, "
                   "as for preprocess_data.py)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help=".json/.jsonl inputs: string fields whose text to learn from; the inputs may come before or "
                        "after it (a word after it that names a file is an input)")
    p.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail", help=".json/.jsonl inputs: " + _BAD_LINE)
    p.add_argument("--type", choices=("bpe", "wordpiece"), default="bpe",
                   help="bpe: byte-level BPE for --tokenizer-type GPT2BPETokenizer, with <|endoftext|>; wordpiece: "
                        "WordPiece for BertWordPieceLowerCase (or BertWordPieceCase with --cased), with [PAD] [UNK] "
                        "[CLS] [SEP] [MASK]")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="tokens in the vocabulary, special tokens included (fewer if the text has no more pieces)")
    p.add_argument("--min-frequency", type=int, default=2, help="times a piece must occur to become a token")
    p.add_argument("--cased", action="store_true", help="WordPiece only: keep case")
    p.add_argument("--output-dir", required=True, help="directory for the files; it must not hold them already")
    return p


def train_tokenizer_main(argv=None) -> int:
    """`launch/train_tokenizer.py`: names the written files on stderr; bad input is one sentence and exit 2."""
    return run_command(_train_tokenizer, argv, _bad_input)


def _inputs_among_keys(inputs: list[str], json_keys: list[str]) -> tuple[list[str], list[str]]:
    """(inputs, json_keys) with the words of --json-keys that name existing files moved to the inputs.

    argparse gives an option of nargs "+" every word after it up to the next flag, so inputs given after the
    keys (`--json-keys text corpus.jsonl`) arrive among them; a JSON field is rarely also a file's name."""
    files = [k for k in json_keys if os.path.isfile(k)]
    return inputs + files, [k for k in json_keys if k not in files]


def _train_tokenizer(argv) -> int:
    from jax3d.data.tokenizers import train_tokenizer

    p = train_tokenizer_parser()
    args = p.parse_args(argv)
    inputs, json_keys = _inputs_among_keys(args.inputs, args.json_keys)
    if not json_keys:
        p.error(f"--json-keys {' '.join(args.json_keys)} names input files but no key; give the JSON field to read "
                "first, e.g. --json-keys text corpus.jsonl")
    if not inputs:
        p.error("no input files given; pass the text files to learn from" if json_keys == ["text"] else
                f"no input files given: --json-keys took {' '.join(json_keys)}, and none of those names a file")
    if args.cased and args.type != "wordpiece":
        p.error("--cased applies to --type wordpiece; a byte-level BPE always keeps case")
    paths = train_tokenizer(inputs, args.output_dir, args.type, args.vocab_size,
                            lower_case=not args.cased, min_frequency=args.min_frequency,
                            json_keys=json_keys, on_bad_line=args.on_bad_line)
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0
