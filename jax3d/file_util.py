"""Output folders and file modes shared by everything jax3d writes (kept free of JAX imports)."""
from __future__ import annotations

import os
import tempfile


def readable_by_all(path: str) -> None:
    """Gives `path` the mode a plain write would (0666 less the umask), not a temporary file's 0600: an
    index cached beside shared data, or an exported model, must be readable by the other users of it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def dir_problem(path: str, probe: bool = True) -> str | None:
    """Why directory `path` can't be written to or created ("is a file", "lies inside file F", "cannot be
    written (Permission denied)"), or None. With `probe`, it tries to create and remove a temporary folder
    there, which leaves nothing: a command checks its output folder before it spends time on work it
    could not save."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        return f"lies inside {here}, which is a file"
    if not probe:
        return None
    try:  # permissions, read-only or special file systems: only trying tells
        tempfile.TemporaryDirectory(dir=here).cleanup()
    except OSError as e:
        return f"cannot be written ({e.strerror} in {here})"
    return None
