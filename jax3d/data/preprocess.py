"""JSONL -> Megatron `.bin/.idx`, the library half of `launch/preprocess_data.py`.

Lines are read in chunks and tokenized by a pool of worker processes; results come back in input
order and one writer appends them, so the output does not depend on the number of workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from jax3d.file_util import dir_problem
from jax3d.data.indexed import DataError, IndexedDatasetBuilder, best_dtype, data_path, index_path
from jax3d.data.jsonl import bad_line, checked_options, line_chunks, parse_line
from jax3d.data.tokenizers import build_tokenizer

# Split after . ! ? when whitespace and then an upper-case letter, digit or opening quote follow,
# and on blank lines. Good enough for English prose without needing punkt (a network download).
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])|\n\s*\n")


def split_sentences(text: str) -> list[str]:
    """Split `text` into sentences with a small regex; empty pieces are dropped."""
    return [s.strip() for s in _SENTENCE_RE.split(text) if s and s.strip()]


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker process needs to rebuild the tokenizer (tokenizers do not pickle cheaply)."""
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_file: str | None = None
    tokenizer_model: str | None = None

    def build(self):
        return build_tokenizer(self.tokenizer_type, self.vocab_file, self.merge_file,
                               self.tokenizer_file, self.tokenizer_model)


@dataclass
class PreprocessSummary:
    """Counts from one preprocessing run."""
    documents: int = 0
    skipped_lines: int = 0
    empty_documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    outputs: list = field(default_factory=list)

    @property
    def docs_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)


# Per-process tokenizer state, set once by the pool initializer (Pool's way of giving each worker
# an object that does not pickle cheaply); never read outside `_encode_chunk`.
_WORKER = {}


def _init_worker(spec, json_keys, append_eod, sentences, in_pool):
    if in_pool:
        # Worker processes already fill the cores; the tokenizers library's own thread pool would
        # only oversubscribe them. A single in-process "worker" keeps it.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = spec.build()
    _WORKER.update(tok=tok, keys=json_keys, eod=append_eod, sentences=sentences)


def _encode_chunk(job):
    """Tokenize a chunk `(lines, nbytes)` of (line_no, line) into one flat array per key.

    Returns `(bad, empty, docs, nbytes)`: `bad` lists (line_no, reason); `docs[key]` is
    (tokens, sequence sizes, sequences per document) for the chunk's good, non-empty documents,
    so the parent writes a chunk with one call and pickling moves a few arrays, not many lists.
    """
    chunk, nbytes = job
    tok, keys, sentences = _WORKER["tok"], _WORKER["keys"], _WORKER["sentences"]
    bad, pieces, counts = [], [], []  # counts[d][k]: how many pieces doc d has for key k
    for line_no, line in chunk:
        obj, why = parse_line(line, keys)
        if why is not None:
            bad.append((line_no, why))
            continue
        counts.append([])
        for k in keys:
            p = split_sentences(obj[k]) if sentences else [obj[k]]
            pieces += p
            counts[-1].append(len(p))
    # One batch call per chunk: the tokenizers library can spread it over threads.
    encoded = iter(tok.tokenize_batch(pieces))
    empty = 0
    toks = {k: [] for k in keys}
    sizes = {k: [] for k in keys}
    per_doc = {k: [] for k in keys}
    for doc_counts in counts:
        doc = {}
        for k, n in zip(keys, doc_counts):
            ids = [s for s in (next(encoded) for _ in range(n)) if s]
            if ids and _WORKER["eod"]:
                ids[-1].append(tok.eod)
            doc[k] = ids
        if not any(doc.values()):
            empty += 1
            continue
        for k, ids in doc.items():
            for s in ids:
                toks[k].extend(s)
                sizes[k].append(len(s))
            per_doc[k].append(len(ids))
    dtype = best_dtype(tok.vocab_size)
    docs = {k: (np.asarray(toks[k], dtype), np.asarray(sizes[k], np.int64),
                np.asarray(per_doc[k], np.int64)) for k in keys}
    return bad, empty, docs, nbytes


def output_prefix_for(output_prefix: str, key: str, split_sentences_: bool) -> str:
    """Megatron's output naming: `<prefix>_<key>_document` or `<prefix>_<key>_sentence`."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences_ else 'document'}"


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer: TokenizerSpec,
                     json_keys=("text",), append_eod: bool = False, split_sentences_: bool = False,
                     workers: int = 1, on_bad_line: str = "fail", chunk_lines: int = 256,
                     progress: bool = True, log=None) -> PreprocessSummary:
    """Tokenize a JSONL file into one indexed dataset per JSON key.

    A bad line (not JSON, not an object, key missing) is reported to `log` with its line number and
    then skipped (`on_bad_line="skip"`) or raises `DataError` (`"fail"`). Documents that tokenize to
    nothing are left out and counted. Returns a `PreprocessSummary`.

    With `workers > 1` the pool uses the spawn start method, so a calling script must keep its
    top-level code under `if __name__ == "__main__":`.
    """
    log = sys.stderr if log is None else log
    json_keys = checked_options(json_keys, on_bad_line)
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1.")
    if not os.path.isfile(input_path):
        raise DataError(f"--input {input_path} does not exist or is not a file.")
    if chunk_lines < 1:
        raise DataError(f"--chunk-lines {chunk_lines} must be at least 1.")
    if not os.path.basename(output_prefix):
        raise DataError(f"--output-prefix {output_prefix} names a folder; add a file name prefix, e.g. "
                        f"{os.path.join(output_prefix, 'corpus')}.")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    problem = dir_problem(out_dir)
    if problem:
        raise DataError(f"--output-prefix {output_prefix}: its folder {problem}; pass another prefix.")
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: output_prefix_for(output_prefix, k, split_sentences_) for k in json_keys}
    tok = tokenizer.build()  # fail here, once, on bad vocab files; also fixes the dtype
    if append_eod and tok.eod is None:
        raise DataError(f"--append-eod needs an end-of-document token but {tokenizer.tokenizer_type} "
                        "has none.")
    taken = [f for p in prefixes.values() for f in (data_path(p), index_path(p)) if os.path.exists(f)]
    if taken:  # the builder would truncate them at once, and a failed run would leave nothing
        raise DataError(f"{' and '.join(taken)} already exist{'s' if len(taken) == 1 else ''}; pass another "
                        "--output-prefix, or delete the old files first.")
    dtype = best_dtype(tok.vocab_size)
    summary = PreprocessSummary()
    builders = {k: IndexedDatasetBuilder(p, dtype) for k, p in prefixes.items()}
    init_args = (tokenizer, json_keys, append_eod, split_sentences_, workers > 1)
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True,
                   desc="preprocess", file=sys.stderr)
    pool = None
    try:
        chunks = line_chunks(input_path, chunk_lines)
        if workers == 1:
            _init_worker(*init_args)
            results = map(_encode_chunk, chunks)
        else:
            # spawn, not fork: the caller may hold JAX or tokenizer threads that fork would copy.
            pool = mp.get_context("spawn").Pool(workers, _init_worker, init_args)
            results = pool.imap(_encode_chunk, chunks, chunksize=1)
        for bad, empty, docs, nbytes in results:
            for no, why in bad:
                summary.skipped_lines += 1
                bad_line(input_path, no, why, on_bad_line, log)
            summary.empty_documents += empty
            for k in json_keys:
                builders[k].add_chunk(*docs[k])
            summary.documents += len(docs[json_keys[0]][2])
            summary.tokens += sum(docs[k][0].size for k in json_keys)
            if bar is not None:
                bar.update(nbytes)
        if not summary.documents:
            raise DataError(f"--input {input_path} holds no document with text under --json-keys "
                            f"{' '.join(json_keys)}; nothing was written.")
    except BaseException:
        # A failed run must not leave a .bin that looks like a finished dataset.
        for k, b in builders.items():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
    for b in builders.values():
        b.finalize()
    summary.seconds = time.perf_counter() - start
    summary.outputs = list(prefixes.values())
    return summary

