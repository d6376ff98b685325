"""The order in which the train state stacks its layers, and the way back to logical order.

An interleaved (virtual stages > 1) or uneven pipeline runs its stacked layers in *pipeline order*
(`jax3d.pipeline.layout`): permuted so that each stage's rows hold its chunks, and padded to p*v*k
rows. Reordering inside the step would move every layer that changes stage twice per step (params
in, gradients out). So the state keeps `params['blocks']`, and the optimizer-state trees that mirror
it (AdamW's mu and nu, sharded or not by ZeRO), in pipeline order from init on, and the step hands the
loop the stack as it is.

Padding rows are zeros. The loop skips them, so their gradients are zeros; the gradient norm does
not see them, and AdamW (a zero moment gives a zero update) and weight decay (of a zero param) leave
them at zero. They cost p*v*k - L rows of memory, and buy a stack that `stage` shards evenly, which a
logical stack of uneven layers is not.

Everything that leaves the step sees logical order: checkpoints are saved per logical layer (so any
layout restores them) and restored into this run's order; evaluation, export and generation read
logical params. `LayerOrder` is the one place that converts.
"""
from __future__ import annotations

import math

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax3d.parallel.mesh import STAGE
from jax3d.pipeline.layout import LayerLayout, from_pipeline_order, to_pipeline_order


def _stack_flags(params):
    """A tree like `params`: True on the stacked-layer leaves."""
    return {k: jax.tree.map(lambda _: k == "blocks", v) for k, v in params.items()}


class LayerOrder:
    """Converts train states, params and their shardings between logical and the state's layer order.

    `layout` None means the state is in logical order and every conversion returns its input.
    """

    def __init__(self, layout: LayerLayout | None, optimizer: optax.GradientTransformation):
        self.layout, self.optimizer = layout, optimizer

    @property
    def logical(self) -> bool:
        return self.layout is None

    # ---- pure functions (jit them) ---------------------------------------------------------------
    def params_to_logical(self, params):
        """Params (or grads) in logical layer order, padding rows dropped."""
        return self._params(params, lambda a: from_pipeline_order(a, self.layout))

    def params_from_logical(self, params):
        """Logical params in the state's order, padding rows zero."""
        return self._params(params, lambda a: to_pipeline_order(a, self.layout))

    def state_to_logical(self, state):
        """The whole train state with params and optimizer moments in logical layer order."""
        return self.map_state(lambda a: from_pipeline_order(a, self.layout), state)

    def state_from_logical(self, state):
        return self.map_state(lambda a: to_pipeline_order(a, self.layout), state)

    # ---- shardings -------------------------------------------------------------------------------
    def logical_spec(self, spec: P) -> P:
        """A stack leaf's spec in logical order: `stage` stays on the layer dim where it divides the
        layers (an uneven split's logical stack is replicated over `stage` here; `moved_spec` moves
        `stage` to another dim instead)."""
        if self.logical or not len(spec) or self.layout.num_layers % self.layout.stages == 0:
            return spec
        return P(None, *tuple(spec)[1:])

    def logical_shardings(self, state):
        """Shardings of the logical-order copy of a state: a TrainState of arrays, or of abstract arrays
        that carry their shardings.

        The stack's specs are `moved_spec`'s: the copy that every save and restore makes takes about as
        much memory per device as the state, not `stages` times the stack's share."""
        moved = self.map_state(lambda a: NamedSharding(a.sharding.mesh, self._logical_stack_spec(a)), state)
        return jax.tree.map(lambda a: a if isinstance(a, NamedSharding) else a.sharding, moved)

    def moved_logical_specs(self, specs, params, mesh):
        """A params-shaped tree of PartitionSpecs in logical order, for `params` (arrays or abstract
        arrays, in the state's order) on `mesh`: only the layer stack's change, to `moved_spec`'s. What
        the eval step gathers its compute copy to."""
        if self.logical:
            return specs
        return {k: jax.tree.map(lambda s, a: self.moved_spec(s, a.shape, mesh), v, params[k],
                                is_leaf=lambda s: isinstance(s, P)) if k == "blocks" else v
                for k, v in specs.items()}

    def moved_spec(self, spec: P, shape: tuple, mesh) -> P:
        """A stack leaf's spec in logical order, for a leaf of `shape` on `mesh`. Where an uneven split
        can't keep `stage` on the layer dim, `stage` moves to the first other dim it divides (a leaf with
        none stays replicated over `stage`), so a device holds about its share of the stack, not all
        of it."""
        logical = self.logical_spec(spec)
        if logical == spec:
            return spec
        entries = list(logical) + [None] * (len(shape) - len(logical))
        for i in range(1, len(shape)):
            axes = entries[i] if isinstance(entries[i], tuple) else () if entries[i] is None else (entries[i],)
            if shape[i] % (math.prod(mesh.shape[x] for x in axes) * mesh.shape[STAGE]) == 0:
                entries[i] = (*axes, STAGE)
                return P(*entries)
        return logical

    def _logical_stack_spec(self, a) -> P:
        return self.moved_spec(a.sharding.spec, a.shape, a.sharding.mesh)

    # ---- plumbing --------------------------------------------------------------------------------
    def _params(self, params, fn):
        if self.logical:
            return params
        return {k: jax.tree.map(fn, v) if k == "blocks" else v for k, v in params.items()}

    def map_state(self, fn, state):
        """`fn` on every stack leaf of a TrainState (params['blocks'], its optimizer-state mirrors, FP8 histories),
        other leaves untouched; leaves may be arrays, abstract arrays or shardings."""
        if self.logical:
            return state
        flags = _stack_flags(state.params)
        opt = optax.tree_utils.tree_map_params(self.optimizer, lambda a, f: fn(a) if f else a,
                                               state.opt_state, flags, is_leaf=_is_sharding)
        fp8 = None if state.fp8 is None else self._params(state.fp8, fn)  # the FP8 histories mirror the stack too
        return state.replace(params=self._params(state.params, fn), opt_state=opt, fp8=fp8)


def _is_sharding(x):
    return isinstance(x, jax.sharding.Sharding)
