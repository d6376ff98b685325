"""File modes shared by everything jax3d writes through a temporary file (kept free of JAX imports)."""
from __future__ import annotations

import os


def readable_by_all(path: str) -> None:
    """Gives `path` the mode a plain write would (0666 less the umask), not a temporary file's 0600: an
    index cached beside shared data, or an exported model, must be readable by the other users of it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
