"""ZeRO stages as sharding transforms: add `data` to a spec, and XLA inserts the collectives."""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


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


def state_specs(param_specs, abstract_params, data_size: int, zero_stage: int) -> dict:
    """Specs of the parameters, gradients and optimizer state (per parameter) for a ZeRO stage.

    Stage 1 shards the optimizer state over `data`; stage 2 also the gradients; stage 3 also the
    parameters, which the step gathers back to `compute` specs where it uses them.
    """
    sharded = zero_specs(param_specs, abstract_params, data_size)
    return {
        "compute": param_specs,
        "params": sharded if zero_stage >= 3 else param_specs,
        "grads": sharded if zero_stage >= 2 else param_specs,
        "opt": sharded if zero_stage >= 1 else param_specs,
    }


def cast_for_compute(params32, dtype, specs):
    """Compute-dtype copy of the parameters, gathered to their compute specs (the ZeRO-3 all-gather)."""
    from jax3d.parallel.rules import constrain_tree
    return constrain_tree(jax.tree.map(lambda a: a.astype(dtype), params32), specs["compute"])
