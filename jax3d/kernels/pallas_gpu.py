"""What jax3d's Pallas (Triton) kernels share: the block a dimension gets, the checks and compiler settings of
their `Tuning`s, and the parsing of a benchmark's "field=value" settings. Where they run is the run's
`jax3d.kernels.policy.KernelPolicy`."""
from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as pltriton


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


def _kernel(tuning_cls) -> str:
    """The kernel module's short name ("fused_gelu") that a Tuning class belongs to."""
    return tuning_cls.__module__.rsplit(".", 1)[-1]
