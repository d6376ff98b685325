"""The argument parser every jax3d command line uses (kept free of JAX imports)."""
from __future__ import annotations

import argparse
import os


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one sentence and exits 2, without argparse's usage dump (--help has it)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def layer_counts(text: str, flag: str) -> tuple[int, ...]:
    """A pipeline layout flag's comma-separated layer counts ('3,5,5,3'); ValueError names the flag."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated layer counts, e.g. 3,5,5,3") from None


def dir_problem(path: str) -> str | None:
    """Why directory `path` can neither be used nor created ("is a file", "is inside file F"), or None."""
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return "is a file, not a directory"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else f"lies inside {parent}, which is a file"
