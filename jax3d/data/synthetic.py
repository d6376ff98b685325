"""Small generated corpora for tests and examples (no downloads)."""
from __future__ import annotations

import json

import numpy as np

_WORDS = ("the of and to in is was for on that with as by at from model data token layer train "
          "mesh stage shard batch loss step python array value index sample query key attention "
          "Megatron JAX BERT GPT pipeline parallel device gradient optimizer").split()


def synthetic_documents(n: int, seed: int = 0, min_sentences: int = 1, max_sentences: int = 5,
                        min_words: int = 3, max_words: int = 12) -> list[str]:
    """`n` short documents of capitalised sentences of random words, deterministic for `seed`."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        sents = []
        for _ in range(rng.integers(min_sentences, max_sentences + 1)):
            words = [_WORDS[j] for j in rng.integers(0, len(_WORDS), rng.integers(min_words, max_words + 1))]
            sents.append(words[0].capitalize() + " " + " ".join(words[1:]) + ".")
        docs.append(" ".join(sents))
    return docs


def write_jsonl(path: str, docs, key: str = "text") -> None:
    """One JSON object `{key: doc}` per line."""
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")
