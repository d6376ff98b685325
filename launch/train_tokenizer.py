"""Train a byte-level BPE (vocab.json + merges.txt) or WordPiece (vocab.txt) on local text files
(plain text, or the .json/.jsonl corpora preprocess_data.py reads).

    python launch/train_tokenizer.py --type bpe --vocab-size 32000 --output-dir tok/ corpus/*.txt
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.argparse_util import OneLineParser, run_command  # noqa: E402
from jax3d.data.indexed import DataError
from jax3d.data.tokenizers import train_tokenizer


def main(argv=None) -> int:
    return run_command(_main, argv, lambda: (DataError, OSError))


def _main(argv) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # "*", not "+": a missing input gets its own message below (--json-keys takes every word after it)
    p.add_argument("inputs", nargs="*", help="plain-text files, or .json/.jsonl corpora (one JSON object a line, "
                   "as for preprocess_data.py)")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help=".json/.jsonl inputs: keys whose text to learn from (give it after the inputs)")
    p.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail",
                   help=".json/.jsonl inputs: what a line that is not a JSON object with those keys does")
    p.add_argument("--type", choices=("bpe", "wordpiece"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--cased", action="store_true", help="WordPiece only: keep case")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    if not args.inputs:
        p.error("no input files given; pass them before --json-keys, which takes every word after it"
                if args.json_keys != ["text"] else "no input files given; pass the text files to learn from")
    if args.cased and args.type != "wordpiece":
        p.error("--cased applies to --type wordpiece; a byte-level BPE always keeps case")
    paths = train_tokenizer(args.inputs, args.output_dir, args.type, args.vocab_size,
                            lower_case=not args.cased, min_frequency=args.min_frequency,
                            json_keys=args.json_keys, on_bad_line=args.on_bad_line)
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
