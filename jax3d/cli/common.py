"""The argument parser every jax3d command line uses (kept free of JAX imports)."""
from __future__ import annotations

import argparse
import os
import select
import sys


def report_error(e: BaseException) -> int:
    """Prints bad input as a command's one sentence and returns its exit code, 2."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def run_command(main, argv, bad_input) -> int:
    """How every jax3d command ends: `main(argv)`'s exit code; bad input, an exception of the types that
    `bad_input()` returns (imported only when one is raised), as its one sentence and exit 2; Ctrl-C as
    "interrupted" and exit 130; and a reader that went away (`| head`) as a quiet exit 141, as for SIGPIPE."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        if not _stdout_reader_gone():  # another pipe or socket broke: not the `| head` case
            return _bad_input_or_bug(e, bad_input)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit fails no more
        return 141
    except Exception as e:
        return _bad_input_or_bug(e, bad_input)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on the writing end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False


def _bad_input_or_bug(e: Exception, bad_input) -> int:
    if isinstance(e, bad_input()):
        return report_error(e)
    raise e


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one sentence and exits 2, without argparse's usage dump (--help has it)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Prints a flag's default once: after its help, unless the help already speaks of it or there is none
    (None, "", [], False, or a flag that takes no value). A list prints as its words (`--json-keys text`)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        # `is`, not `in`: 0 == False, and a default of 0 is worth printing.
        if "default" in text or any(default is v for v in (None, "", False, argparse.SUPPRESS)) or action.nargs == 0 \
                or default == []:
            return text
        if isinstance(default, (list, tuple)):
            return f"{text} (default: {' '.join(map(str, default))})"
        return f"{text} (default: {default})"


class ExampleHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that prints the description as written, so a command example in it keeps its lines."""


def add_device_flags(p) -> None:
    """The device and multi-host flags of every command that runs a model (`jax3d.cli.train.setup_devices` reads
    them)."""
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="emulate N CPU devices (default: 8 when no accelerator is present, else the accelerators)")
    p.add_argument("--coordinator-address", default="", metavar="HOST:PORT",
                   help="address of process 0 of a multi-host run; give it with --num-processes and --process-id "
                        "on every host (default: none: one host, or the run that SLURM or Open MPI describes)")
    p.add_argument("--num-processes", type=int, default=0, metavar="N",
                   help="processes of a multi-host run, usually one a host (default: 0: one process, or SLURM's or "
                        "Open MPI's count)")
    p.add_argument("--process-id", type=int, default=-1, metavar="I",
                   help="this process's index in a multi-host run, from 0 to --num-processes - 1 (default: -1: one "
                        "process, or SLURM's or Open MPI's rank)")
    p.add_argument("--compilation-cache-dir", default="", metavar="DIR",
                   help="keep compiled programs in DIR and reuse them in later runs of the same shapes and layout, "
                        "so a resumed run skips compiling its step (JAX's persistent compilation cache; FP8 steps "
                        "take minutes to compile on a GPU) (default: none)")


def add_model_parallel_flags(p, pipeline: bool = True) -> None:
    """The tensor (and pipeline) sizes of a command that runs a trained model on a layout of its own: any
    layout reads any checkpoint. Training chooses its layout otherwise (`train_flags`)."""
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                   help="devices each layer's heads, MLP and vocabulary are split over (mesh axis `model`)")
    if pipeline:
        p.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="N",
                       help="pipeline stages the layers are divided into (mesh axis `stage`)")


def add_decode_dtype_flags(p) -> None:
    """Generation's KV cache type and weight type (the precision policy's `cache_dtype`, `weight_dtype`:
    jax3d.parallel.precision), for generate and the decode benchmarks."""
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="the KV cache's type: auto keeps the compute type; fp8 (e4m3, unscaled) halves a bf16 "
                        "cache's memory and the bytes each token reads of it (an fp32 cache's, quarters), at some "
                        "accuracy (default: auto)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="generation's GEMM weights (the blocks' and the vocabulary tables): none keeps the compute "
                        "type; fp8 stores them in e4m3 with a scale per output column, half of bf16's bytes for each "
                        "token to read, at some accuracy; the checkpoint is not changed (default: none)")


def layer_counts(text: str, flag: str) -> tuple[int, ...]:
    """A pipeline layout flag's comma-separated layer counts ('3,5,5,3'); ValueError names the flag."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated layer counts, e.g. 3,5,5,3") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"{flag} {text!r} leaves a stage without layers; give every stage at least one")
    return counts
