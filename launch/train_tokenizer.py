"""Train a byte-level BPE (vocab.json + merges.txt) or WordPiece (vocab.txt) on local text files.

    python launch/train_tokenizer.py --type bpe --vocab-size 32000 --output-dir tok/ corpus/*.txt
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.argparse_util import OneLineParser, report_error  # noqa: E402
from jax3d.data.indexed import DataError
from jax3d.data.tokenizers import train_tokenizer


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="plain-text files")
    p.add_argument("--type", choices=("bpe", "wordpiece"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--cased", action="store_true", help="WordPiece only: keep case")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    if args.cased and args.type != "wordpiece":
        p.error("--cased applies to --type wordpiece; a byte-level BPE always keeps case")
    try:
        paths = train_tokenizer(args.inputs, args.output_dir, args.type, args.vocab_size,
                                lower_case=not args.cased, min_frequency=args.min_frequency)
    except (DataError, OSError) as e:
        return report_error(e, 1)
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
