"""Which of a chunk's vjp residuals the forward pass must store, and rebuilding the pullback later.

`jax.vjp` returns its pullback as a pytree whose leaves are the residuals: activations the backward
pass reads, but also the weights themselves, their transposes and casts, dropout masks and padding
masks. Only what depends on the chunk's input activation has to wait in a loop buffer from F to B;
the rest is a function of the weights, keys and micro-batch, which B has anyway. B therefore traces
the same vjp on a zero input, keeps its input-independent leaves, swaps in the stored ones, and XLA
removes the dead zero-input forward (nothing reads it).
"""
from __future__ import annotations

import jax
from jax.extend.core import Literal


def input_dependent(fn, args, dirty_argnum: int) -> list[bool]:
    """For `fn(*args)` returning a flat list of arrays: which of them depend on `args[dirty_argnum]`.

    A conservative data-flow pass over the jaxpr: an equation's outputs depend on the input as soon
    as any of its operands does (so a leaf is never wrongly taken for a weight-only one)."""
    closed = jax.make_jaxpr(fn)(*args)
    invars = list(closed.jaxpr.invars)
    dirty, pos = set(), 0
    for n, a in enumerate(args):
        count = len(jax.tree.leaves(a))
        if n == dirty_argnum:
            dirty.update(invars[pos:pos + count])
        pos += count
    for eqn in closed.jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in dirty for v in eqn.invars):
            dirty.update(eqn.outvars)
    return [not isinstance(v, Literal) and v in dirty for v in closed.jaxpr.outvars]


def rebuild(pullback, mask, stored):
    """`pullback` (traced on any input) with its input-dependent leaves replaced by `stored`."""
    leaves, tree = jax.tree.flatten(pullback)
    if len(leaves) != len(mask):
        raise ValueError(f"the chunk's vjp has {len(leaves)} residuals here but {len(mask)} when stored")
    it = iter(stored)
    return jax.tree.unflatten(tree, [next(it) if keep else leaf for leaf, keep in zip(leaves, mask)])
