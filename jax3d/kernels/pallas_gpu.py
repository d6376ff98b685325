"""What jax3d's Pallas (Triton) kernels share: where they may run, the block a dimension gets, the checks
and compiler settings of their `Tuning`s, and the benchmarks' way to run them with other settings."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jax.experimental.pallas import triton as pltriton

from jax3d.kernels import DECODE_KERNELS, KERNELS
from jax3d.parallel.rules import ShardingRules, traced_platform


def on_one_gpu(rules: ShardingRules) -> bool:
    """Whether the computation being traced runs on a single GPU: the kernels are not partitioned over a mesh."""
    return traced_platform() == "gpu" and rules.single_device()


def block_width(n: int) -> int:
    """Triton's blocks are powers of two: a dimension of `n` gets the next one up, its tail masked."""
    return 1 << (n - 1).bit_length()


def check_powers_of_two(tuning, *fields: str) -> None:
    """Raises ValueError naming the first of `fields` of `tuning` that is not a power of two (Triton's
    block shapes and warp counts are)."""
    for name in fields:
        n = getattr(tuning, name)
        if n < 1 or n & (n - 1):
            raise ValueError(f"{_kernel(type(tuning))}.{tuning}: {name}={n} must be a power of two")


def compiler_params(num_warps: int, interpret: bool, num_stages: int = 0):
    """Triton's settings for a pallas_call (`num_stages` 0: Triton's own); none in Pallas' interpreter."""
    return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages or None)


def fields(tuning) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(tuning))


def parse_tuning(cls, settings: str):
    """`cls()` (a kernel's Tuning) with "field=value,..." changed; "" is the defaults. ValueError names
    what is wrong."""
    names = fields(cls)
    changes = {}
    for item in filter(None, settings.split(",")):
        name, _, value = item.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = None
        if name not in names or number is None:
            raise ValueError(f"{_kernel(cls)}: {item!r} is not FIELD=INTEGER for a field of {cls()}")
        if name in changes:
            raise ValueError(f"{_kernel(cls)}: {name} is given twice")
        changes[name] = number
    return cls(**changes)


# A benchmark's settings for the kernels, by kernel name: a Tuning, or None for "not used". A context rather
# than a ModelConfig field: block shapes (and a kernel left out to measure it) change how a model runs on one
# GPU, never what it computes, and no training flag sets them.
_SETTINGS: contextvars.ContextVar[dict] = contextvars.ContextVar("jax3d_pallas_settings", default={})


@contextlib.contextmanager
def kernel_settings(*tunings, off=()):
    """Within it, what is traced runs each kernel that one of `tunings` belongs to with that Tuning instead of
    its DEFAULT, and the kernels named in `off` (KERNELS, DECODE_KERNELS) not at all: their plain JAX function
    runs, as on a CPU. For benchmarks. Only tracing reads it, so a function jitted outside and called inside keeps the
    settings it was traced with."""
    unknown = unknown_kernels(off)
    if unknown:
        raise ValueError(f"no kernel {', '.join(unknown)}; choose from {', '.join(KERNELS + DECODE_KERNELS)}")
    token = _SETTINGS.set({**_SETTINGS.get(), **{_kernel(type(t)): t for t in tunings}, **dict.fromkeys(off)})
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def unknown_kernels(names) -> list[str]:
    """Those of `names` that are no kernel of jax3d's (KERNELS, DECODE_KERNELS), sorted."""
    return sorted(set(names) - set(KERNELS + DECODE_KERNELS))


def tuning(kernel):
    """The Tuning that `kernel` (one of the kernel modules) runs with in what is being traced: its DEFAULT,
    or what `kernel_settings` gives; None where that leaves the kernel out."""
    return _SETTINGS.get().get(_kernel(kernel.Tuning), kernel.DEFAULT)


def _kernel(tuning_cls) -> str:
    """The kernel module's short name ("fused_gelu") that a Tuning class belongs to."""
    return tuning_cls.__module__.rsplit(".", 1)[-1]
