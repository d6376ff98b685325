"""The host's side of generation: each row's text as its tokens arrive in chunks, cut at the end-of-document
token or the first stop string, and how much of it can be printed while more may come; `generate_text`, the
continuations of text prompts by a checkpoint.

Stop strings are text, not tokens (a string may end inside a token, or span several), so they are checked on
the detokenized text after every chunk; a row that hits one is halted, which the Generator hands the device
with the next chunk it dispatches."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax3d.inference.generate import PAD, Sampling, generator_for, load_gpt_checkpoint

FINISH = ("eod", "stop", "length")  # why a row ended: its end-of-document token, a stop string, its token budget


class Completions:
    """Rows of text built from `Generator.stream`'s chunks (`add`). `stops` holds each row's stop strings;
    `eod` (None: none) ends a row without being part of its text. `halt` is the array to pass the stream."""

    def __init__(self, tokenizer, stops: list[list[str]], eod: int | None = None):
        self.tokenizer, self.stops, self.eod = tokenizer, [[s for s in row if s] for row in stops], eod
        self.tokens: list[list[int]] = [[] for _ in stops]
        self.halt = np.zeros(len(stops), bool)
        self.finish: list[str | None] = [None] * len(stops)
        self._cut: list[int | None] = [None] * len(stops)

    def add(self, chunk_rn: np.ndarray) -> None:
        """Takes the next tokens of every row (rows, n), PAD where a row made none."""
        for i, row in enumerate(chunk_rn):
            if self.finish[i] is not None:
                continue  # tokens the device made before it learnt of a stop string
            new = [int(t) for t in row if t != PAD]
            if self.eod is not None and self.eod in new:
                new, self.finish[i] = new[:new.index(self.eod)], "eod"
            self.tokens[i] += new
            if new and self.stops[i]:
                text = self.tokenizer.detokenize(self.tokens[i])
                hits = [at for at in (text.find(s) for s in self.stops[i]) if at >= 0]
                if hits:
                    self._cut[i], self.finish[i], self.halt[i] = min(hits), "stop", True

    def text(self, i: int) -> str:
        """Row i's text so far, without its stop string and what followed it."""
        return self.tokenizer.detokenize(self.tokens[i])[:self._cut[i]]

    def settled(self, i: int) -> str:
        """The part of `text(i)` that more tokens will not change: all of it once the row is finished, else
        without a trailing partial character or a tail that a stop string may begin with."""
        text = self.text(i)
        if self.finish[i] is not None:
            return text
        text = text.rstrip("\ufffd")
        held = max((n for s in self.stops[i] for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[:len(text) - held]

    def close(self) -> None:
        """The stream has ended: rows that are still open ran out of tokens."""
        self.finish = [f or "length" for f in self.finish]


def generate_text(load: str, prompts: list[str], max_new_tokens: int, sampling: Sampling = Sampling(greedy=True), *,
                  tp: int = 1, dtype=jnp.float32, seed: int = 0, step: int = -1, stop: tuple[str, ...] = (),
                  cache_dtype=None, weight_dtype=None) -> list[str]:
    """The continuation of each text prompt by checkpoint `load`, up to the end-of-document token or the
    first of the `stop` strings (left out); the KV cache in `cache_dtype` (None: `dtype`), the GEMM weights
    in `weight_dtype` (None: `dtype`; see Generator)."""
    cfg, params, tok = load_gpt_checkpoint(load, step)
    ids = [tok.tokenize(p) for p in prompts]
    gen = generator_for(cfg, params, tok, ids, max_new_tokens, tp=tp, dtype=dtype, checkpoint=load,
                        cache_dtype=cache_dtype, weight_dtype=weight_dtype)
    out = Completions(tok, [list(stop)] * len(ids), gen.eod)
    for chunk in gen.stream(ids, max_new_tokens, sampling, seed, stop_at_eod=gen.eod is not None, halt=out.halt):
        out.add(chunk)
    return [out.text(i) for i in range(len(ids))]
