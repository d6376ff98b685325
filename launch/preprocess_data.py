r"""Tokenize a JSONL corpus into Megatron `.bin/.idx` files (Megatron's flag names).

    python launch/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.argparse_util import OneLineParser, run_command  # noqa: E402
from jax3d.data.indexed import DataError
from jax3d.data.preprocess import TokenizerSpec, preprocess_jsonl
from jax3d.data.tokenizers import TOKENIZER_TYPES


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-file")
    p.add_argument("--append-eod", action="store_true", help="append end-of-document to each document")
    p.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (BERT)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail")
    p.add_argument("--dataset-impl", choices=("mmap",), default="mmap",
                   help="accepted for Megatron scripts; mmap is the only format written")
    p.add_argument("--chunk-lines", type=int, default=256, help="lines per worker task")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_command(_main, argv, lambda: (DataError, OSError))


def _main(argv) -> int:
    args = parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_file)
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


if __name__ == "__main__":
    sys.exit(main())
