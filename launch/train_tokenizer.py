"""Train a byte-level BPE (vocab.json + merges.txt) or WordPiece (vocab.txt) on local text files.
`python launch/train_tokenizer.py --help` lists the flags.

    python launch/train_tokenizer.py --type bpe --vocab-size 32000 --output-dir tok/ corpus/*.txt
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.cli.data import train_tokenizer_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_tokenizer_main())
