"""Megatron's loose-JSON corpora, one JSON object per line: read the same way by preprocessing
(`launch/preprocess_data.py`) and by tokenizer training (`launch/train_tokenizer.py`)."""
from __future__ import annotations

import json
import sys

from jax3d.data.indexed import DataError

JSON_SUFFIXES = (".json", ".jsonl")  # the README's corpus.jsonl, and Megatron's examples' corpus.json


def is_json_lines(path: str) -> bool:
    """Whether `path` names a loose-JSON corpus (by its suffix) rather than plain text."""
    return path.lower().endswith(JSON_SUFFIXES)


def checked_options(json_keys, on_bad_line: str) -> list[str]:
    """`json_keys` as a list; DataError for an empty or repeated key or an unknown `on_bad_line`."""
    json_keys = list(json_keys)
    if not all(json_keys) or len(set(json_keys)) < len(json_keys):
        raise DataError(f"--json-keys {' '.join(map(repr, json_keys))} has an empty or repeated key; name each "
                        "JSON field to read once, e.g. --json-keys text.")
    if on_bad_line not in ("skip", "fail"):
        raise DataError(f"--on-bad-line {on_bad_line} is not valid; choose skip or fail.")
    return json_keys


def parse_line(line: str, keys) -> tuple[dict | None, str | None]:
    """(JSON object, None) for a usable line, else (None, why it is bad)."""
    if not line.strip():
        return None, "blank line"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    missing = [k for k in keys if not isinstance(obj.get(k), str)]
    if missing:
        return None, f"no string field {missing[0]!r}"
    return obj, None


def bad_line(path: str, line_no: int, why: str, on_bad_line: str, log=None) -> None:
    """DataError for a bad line under `on_bad_line="fail"`; under "skip", a note to `log` (stderr)."""
    if on_bad_line == "fail":
        raise DataError(f"{path} line {line_no}: {why}; fix the line or pass --on-bad-line skip.")
    print(f"{path} line {line_no}: {why}; skipped.", file=sys.stderr if log is None else log)


def line_chunks(path: str, chunk_lines: int):
    """Chunks `([(line_no, line), ...], nbytes)` of `chunk_lines` lines of `path`."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        chunk, nbytes = [], 0
        for no, line in enumerate(f, start=1):
            chunk.append((no, line))
            nbytes += len(line)
            if len(chunk) == chunk_lines:
                yield chunk, nbytes
                chunk, nbytes = [], 0
        if chunk:
            yield chunk, nbytes


def texts(path: str, keys=("text",), on_bad_line: str = "fail", log=None):
    """The strings under `keys` of each good line of `path`, in order (a bad line goes to `bad_line`)."""
    for chunk, _ in line_chunks(path, 256):
        for no, line in chunk:
            obj, why = parse_line(line, keys)
            if why is not None:
                bad_line(path, no, why, on_bad_line, log)
                continue
            for k in keys:
                yield obj[k]
