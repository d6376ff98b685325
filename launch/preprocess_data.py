r"""Tokenize a JSONL corpus into Megatron `.bin/.idx` files (Megatron's flag names).

    python launch/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.cli.data import preprocess_main  # noqa: E402

if __name__ == "__main__":  # --workers > 1 starts processes that import this file again
    sys.exit(preprocess_main())
