"""XLA options jax3d passes per program, and how XLA_FLAGS overrides them.

An option passed to `jax.jit(..., compiler_options=...)` overrides the same option in XLA_FLAGS, so jax3d passes
each of its own (decode's command buffers, the FP8 step's autotuning level) only where XLA_FLAGS does not name
it: a flag set by hand wins (to debug, or to measure without the option). Backends other than the one an option
is for ignore it.
"""
from __future__ import annotations

import os


def unless_in_xla_flags(options: dict, env=os.environ) -> dict:
    """`options` less those XLA_FLAGS (in `env`) sets itself."""
    flags = env.get("XLA_FLAGS", "")
    return {name: value for name, value in options.items() if name not in flags}
