"""The argument parser every jax3d command line uses (kept free of JAX imports)."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one sentence and exits 2, without argparse's usage dump (--help has it)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")
