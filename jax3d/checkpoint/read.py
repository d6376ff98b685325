"""Reading a checkpoint directory: its complete steps, one step's metadata, and its arrays restored onto the
shardings a caller gives. Every failure is one ConfigError sentence that names the fix, and a restore that
fails part-way leaves no tracebacks from the reads still running (`_quiet_after_failed_read`). Writing, and
what a run does with what it reads, are `checkpoint.py`'s.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings

import jax

from jax3d.config import TOKENIZER_FILE_KEYS, ConfigError, config_from_dict
from jax3d.checkpoint.files import FILE_LIST, check_files, record_files  # noqa: F401 (read's callers use them)


def orbax_checkpoint():
    import orbax.checkpoint as ocp
    return ocp


def _quiet_orbax() -> None:
    """Orbax warns at WARNING level about routine things (read-only managers, items not asked for)."""
    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)


def list_steps(directory: str) -> list[int]:
    """Complete (finalized) checkpoint steps in `directory`, ascending; [] when there are none."""
    if not directory or not os.path.isdir(directory):
        return []
    with manager(directory, read_only=True) as mgr:
        return sorted(mgr.all_steps())


def manager(directory: str, *, read_only: bool, keep: int = 0, async_save: bool = True):
    ocp = orbax_checkpoint()
    _quiet_orbax()
    kw = {}
    if keep > 0:
        kw["preservation_policy"] = ocp.checkpoint_managers.LatestN(keep)
    options = ocp.CheckpointManagerOptions(
        read_only=read_only, create=not read_only, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,  # left by a killed save; never taken as a step
        **kw)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def check_outside_checkpoint(flag: str, path: str) -> None:
    """ConfigError when new `path` would make or sit inside a folder named by a number directly in a jax3d
    checkpoint directory. Orbax takes every such folder for a step (`ck/99` became the latest step, which
    --load failed on), and a later save may delete a step's folder with all it holds (--keep-checkpoints).
    Other names there (`ck/logs`, the checkpoint's own `tokenizer/`) and numbered folders elsewhere are fine."""
    folder = os.path.realpath(path)  # a link to a step's folder is that folder
    target = folder
    while os.path.dirname(folder) != folder:
        up, name = os.path.dirname(folder), os.path.basename(folder)
        steps = _jax3d_steps(up) if name.isdigit() else []
        if steps:
            if folder != target and int(name) in steps and os.path.isdir(folder):
                raise ConfigError(f"{flag} {path} is inside the folder of step {int(name)} of the checkpoint in "
                                  f"{up}, which a later save may delete (--keep-checkpoints) with everything in "
                                  f"it; put it outside {folder}")
            what = f"{flag} {path}" if folder == target else f"{flag} {path} needs {folder}, which"
            raise ConfigError(f"{what} would be read as step {int(name)} of the checkpoint in {up}; give the folder a "
                              "name that is not a number, or put it outside that directory")
        folder = up


def _jax3d_steps(directory: str) -> list[int]:
    """The steps of `directory` when it is a jax3d checkpoint directory, else []."""
    steps = list_steps(directory)
    if not steps:
        return []
    try:
        read_meta(directory, steps[-1])
    except ConfigError:
        return []  # numbered folders, but not jax3d's checkpoints
    return steps


def resolve_step(directory: str, steps: list[int], want: int) -> int:
    """`want` when it is a complete step of `directory` (ConfigError otherwise); the latest when -1."""
    if want < -1:
        raise ConfigError(f"--ckpt-step {want} is not a step; pass a step of --load {directory} "
                          f"({steps or 'none'}), or leave it out for the latest")
    if want >= 0:
        if want not in steps:
            raise ConfigError(f"--ckpt-step {want} is not a complete checkpoint in --load {directory}; "
                              f"it has steps {steps or 'none'}")
        return want
    return steps[-1]


def no_checkpoint(directory: str, fix: str = "pass a directory written by --save") -> str:
    """The sentence for a --load that holds no checkpoint: one step's folder (ck/30) is named as such, with
    its parent and --ckpt-step to pass instead."""
    parent, name = os.path.split(os.path.normpath(os.path.abspath(directory)))
    if name.isdigit() and int(name) in list_steps(parent):
        return f"--load {directory} is step {int(name)} of the checkpoint in {parent}; pass --load {parent} " \
               f"--ckpt-step {int(name)}"
    return f"--load {directory} holds no complete checkpoint; {fix}"


def saved_step_meta(directory: str, want: int = -1) -> tuple[int, dict]:
    """(step, metadata) of checkpoint step `want` (the latest when -1) in `directory`; ConfigError if none."""
    found = list_steps(directory)
    if not found:
        raise ConfigError(no_checkpoint(directory))
    step = resolve_step(directory, found, want)
    return step, read_meta(directory, step)


def read_meta(directory: str, step: int) -> dict:
    """The JSON metadata of one checkpoint step; ConfigError when it can't be read."""
    ocp = orbax_checkpoint()
    try:
        with manager(directory, read_only=True) as mgr:
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises several types for missing / corrupt files
        raise ConfigError(f"checkpoint {directory} step {step} is unreadable ({type(e).__name__}: "
                          f"{_first_line(e, 200)}); pass another --ckpt-step or --load") from e
    if not isinstance(meta, dict) or meta.get("format") != "jax3d":
        raise ConfigError(f"checkpoint {directory} step {step} has no jax3d metadata; it was not written by "
                          "jax3d's Checkpointer")
    missing = [k for k in _META_FIELDS if not _has(meta, k)]
    if missing:
        raise ConfigError(f"checkpoint {directory} step {step} has damaged metadata (no {', '.join(missing)}); "
                          "pass another --ckpt-step or --load")
    try:  # the model it describes must be one: every reader builds it
        config_from_dict(meta["config"])
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {directory} step {step} has damaged metadata ({e}); pass another --ckpt-step "
                          "or --load") from None
    _find_kept_tokenizer(directory, meta)
    return meta


def _find_kept_tokenizer(directory: str, meta: dict) -> None:
    """Points `meta`'s tokenizer files at the checkpoint's own copies (`<directory>/tokenizer/`) where the
    recorded absolute paths are gone: a checkpoint moved, or copied to another machine."""
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        return
    for key in TOKENIZER_FILE_KEYS:
        recorded = tok.get(key)
        kept = os.path.join(os.path.abspath(directory), "tokenizer", os.path.basename(recorded or ""))
        if recorded and not os.path.exists(recorded) and os.path.isfile(kept):
            tok[key] = kept


# What every reader of a checkpoint's metadata relies on ("a.b": key b inside dict a).
_META_FIELDS = ("step", "jax3d_version", "mesh", "loader.consumed_samples", "config.model", "config.parallel")


def _has(meta: dict, dotted: str) -> bool:
    for k in dotted.split("."):
        if not isinstance(meta, dict) or k not in meta:
            return False
        meta = meta[k]
    return True


def _first_line(e: Exception, limit: int) -> str:
    """The message's first line, without the object dump TensorStore appends ("See full ... details")."""
    return str(e).splitlines()[0].split(" See full ")[0].rstrip(".")[:limit] if str(e) else ""


def _check_tree(saved, directory: str, step: int, item: str, target) -> None:
    """Compares the saved tree (paths and shapes) with the target, to fail with a sentence, not a traceback."""
    if saved is None:
        return
    flat_saved = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(saved)[0]}
    for path, t in jax.tree_util.tree_flatten_with_path(target)[0]:
        key = jax.tree_util.keystr(path)
        s = flat_saved.get(key)
        if s is None:
            # Orbax may key sequences and dataclasses differently; only compare what lines up.
            continue
        shape = getattr(s, "shape", None)
        if shape is not None and tuple(shape) != tuple(t.shape):
            raise ConfigError(f"checkpoint {directory} step {step} holds {item}{key} with shape {tuple(shape)} "
                              f"but this run expects {tuple(t.shape)}; the model or optimizer differs")


def _saved_item(mgr, step: int, item: str):
    """The saved metadata tree of one item, or None: metadata is optional, and the restore itself
    reports what is wrong."""
    try:
        return mgr.item_metadata(step)[item]
    except Exception:
        return None


def _echo_of_failed_read(exc) -> bool:
    """Whether an exception is what a restore's other reads leave behind once one has failed: orbax's event
    loop already closed, or an error from TensorStore or orbax's reading code that nothing waits for any more."""
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    if exc is not None and re.search(r"OCDBT|TensorStore", str(exc)):  # a read's error, set on its future in C
        return True
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        if re.search(r"[/\\](orbax|tensorstore)[/\\]", tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


class _NoEchoes(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" reports of orbax reads (see _quiet_after_failed_read)."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in record.getMessage() and _echo_of_failed_read(exc))


@contextlib.contextmanager
def _quiet_after_failed_read():
    """Around a restore. When one read fails, orbax raises and closes its event loop while TensorStore's other
    reads are still running; as they finish they report a closed loop or their own errors (unraisable
    exceptions, asyncio's "exception was never retrieved", coroutines never awaited), tracebacks printed after,
    and sometimes before, the one error this module raises. Those reports, and only they, are dropped; anything
    else still reaches the hook found here. After a failure the filters stay, since reads can finish at any
    time up to exit; after a success they go."""
    previous, no_echoes = sys.unraisablehook, _NoEchoes()
    if getattr(previous, "drops_echoes_of_failed_reads", False):  # an earlier restore failed: already quiet
        yield
        return

    def hook(unraisable):
        if not _echo_of_failed_read(unraisable.exc_value):
            previous(unraisable)
    hook.drops_echoes_of_failed_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(no_echoes)
    try:
        yield
    except BaseException:
        # orbax's reads never started are collected unawaited, each a RuntimeWarning (its coroutines' names)
        warnings.filterwarnings("ignore", message="coroutine '(_read_array_index_and_device_put|async_deserialize)' "
                                "was never awaited", category=RuntimeWarning)
        raise
    sys.unraisablehook = previous
    logging.getLogger("asyncio").removeFilter(no_echoes)


def restore_arrays(directory: str, step: int, items: dict, partial=(), checked: bool = False):
    """Restores orbax items {name: target tree of sharded ShapeDtypeStructs}; ConfigError when unreadable.
    The items named in `partial` may leave out parts of what was saved. `checked`: the caller has already run
    `check_files` on the step (its checksums read every byte), so only the sizes are compared again."""
    ocp = orbax_checkpoint()
    check_files(directory, step, contents=not checked, items=(*items, "meta"))  # the bytes this reader reads

    def restore_args(name, target):
        if name not in partial:
            return ocp.args.StandardRestore(target)
        return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
    args = ocp.args.Composite(**{k: restore_args(k, v) for k, v in items.items()})
    with manager(directory, read_only=True) as mgr:
        for name, target in items.items():
            _check_tree(_saved_item(mgr, step, name), directory, step, name, target)
        try:
            with _quiet_after_failed_read():
                return mgr.restore(step, args=args)
        except Exception as e:
            raise ConfigError(f"checkpoint {directory} step {step} could not be restored ({type(e).__name__}: "
                              f"{_first_line(e, 300)}); it may be damaged or from another model, pass another "
                              "--ckpt-step or --load") from e
