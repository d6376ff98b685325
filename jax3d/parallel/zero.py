"""ZeRO: which state is sharded over `data` (ZeroPlan), and the sharding transforms that do it: add `data` to a
spec, and XLA inserts the collectives."""
from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

from jax3d.config import ConfigError


@dataclass(frozen=True)
class ZeroPlan:
    """What ZeRO shards over `data`. The train state's specs, the step's gradient accumulation and the
    pipeline loop read these facts, never the stage number."""

    optimizer_state: bool = False  # the optimizer's moments and fp32 master weights (ZeRO-1)
    gradients: bool = False  # the accumulated gradients, reduce-scattered (ZeRO-2)
    parameters: bool = False  # the parameters, gathered where they are used (ZeRO-3)

    @classmethod
    def of(cls, zero_stage: int | None, data: int) -> "ZeroPlan":
        """ZeRO-`zero_stage` on `data` data shards; with one shard there is nothing to shard over."""
        if zero_stage is None:
            raise ConfigError("the ZeRO stage is automatic (None) in this config; pass it through "
                              "jax3d.parallel.plan.resolve, which chooses it")
        stage = zero_stage if data > 1 else 0
        return cls(optimizer_state=stage >= 1, gradients=stage >= 2, parameters=stage >= 3)


def default_zero_stage(data: int) -> int:
    """The ZeRO stage of a run that leaves it open: ZeRO-1 when there is data parallelism, else none."""
    return 1 if data > 1 else 0


def add_data_axis(spec: P, shape: tuple[int, ...], data_size: int, axis: str = "data") -> P:
    """Puts `axis` on the first unsharded dim that `data_size` divides; leaves the spec if none does."""
    if data_size <= 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    if any(axis == p or (isinstance(p, tuple) and axis in p) for p in parts):
        return spec
    for i, (p, n) in enumerate(zip(parts, shape)):
        if p is None and n % data_size == 0 and n >= data_size:
            parts[i] = axis
            return P(*parts)
    return spec


def zero_specs(specs, shapes, data_size: int):
    """Applies `add_data_axis` leafwise; `shapes` is a matching tree of ShapeDtypeStructs or arrays."""
    return jax.tree.map(lambda s, x: add_data_axis(s, x.shape, data_size), specs, shapes,
                        is_leaf=lambda x: isinstance(x, P))


def state_specs(param_specs, abstract_params, data_size: int, zero: ZeroPlan) -> dict:
    """Specs of the parameters, gradients and optimizer state (per parameter) for a ZeRO plan.

    Sharded parameters are gathered back to the `compute` specs where the step uses them.
    """
    sharded = zero_specs(param_specs, abstract_params, data_size)
    return {
        "compute": param_specs,
        "params": sharded if zero.parameters else param_specs,
        "grads": sharded if zero.gradients else param_specs,
        "opt": sharded if zero.optimizer_state else param_specs,
    }


def cast_for_compute(params32, dtype, specs):
    """Compute-dtype copy of the parameters, gathered to their compute specs (the ZeRO-3 all-gather)."""
    from jax3d.parallel.rules import constrain_tree
    return constrain_tree(jax.tree.map(lambda a: a.astype(dtype), params32), specs["compute"])
