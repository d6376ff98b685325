"""jax3d's Pallas (Triton) kernels, the only place that writes a pallas_call, in one registry.

Each kernel is a module of this package that registers one `Kernel`: its name, its `Tuning` (block shapes and
warps) and `DEFAULT`, a `supported` test of the shapes it takes (never of the platform: which kernels run is
the run's `jax3d.kernels.policy.KernelPolicy`, decided once), the implementation, and the plain JAX function
it stands in for (`reference`), which runs wherever the kernel does not. `pallas_gpu` holds what they share.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# The kernels by module name: the train step's, and generation's.
KERNELS = ("fused_gelu", "fused_norm", "fused_qkv", "fused_xent", "fp8_cast")
DECODE_KERNELS = ("decode_attention", "row_gemv")


@dataclass(frozen=True)
class Kernel:
    """One registered kernel. `supported(*shape_args, tuning)` says whether `run` takes those arguments with
    `tuning`; `reference` computes what `run` computes, in plain JAX."""

    name: str
    Tuning: type
    DEFAULT: object
    supported: Callable[..., bool]
    run: Callable
    reference: Callable


_REGISTRY: dict[str, Kernel] = {}


def register(name: str, tuning_cls: type, default, supported, run, reference) -> Kernel:
    """Adds a kernel module's entry (called once, at the end of the module)."""
    entry = Kernel(name, tuning_cls, default, supported, run, reference)
    _REGISTRY[name] = entry
    return entry


def kernel(name: str) -> Kernel:
    """The registered kernel `name` (one of KERNELS or DECODE_KERNELS); ValueError names an unknown one."""
    if name not in KERNELS + DECODE_KERNELS:
        raise ValueError(f"no kernel {name!r}; choose from {', '.join(KERNELS + DECODE_KERNELS)}")
    if name not in _REGISTRY:
        importlib.import_module(f"{__name__}.{name}")  # registers it
    return _REGISTRY[name]


def module(name: str):
    """The kernel module that `name` (one of KERNELS or DECODE_KERNELS) names."""
    kernel(name)
    return importlib.import_module(f"{__name__}.{name}")
