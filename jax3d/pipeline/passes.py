"""The work of one pipeline action on one chunk: F, the fused backward, and the split B / W.

These are the functions the loop's branches run (loop.py adds buffers, sends and `data`-varying
marks around them) and that benchmarks/stage_times.py times on their own.

`chunk(wc, x) -> y` is the chunk's forward. F runs it under `jax.vjp` and keeps the residuals that
depend on x (residuals.py); every backward rebuilds the pullback from them and runs no forward.

The split: the pullback, traced to a jaxpr and flattened (calls and `jax.checkpoint` regions inlined),
is cut in two. B is every equation the input grad needs; W is what only the weight grads need (in a
transformer: one GEMM per weight, bias and layer-norm reductions). The cotangents W reads from B's
side of the cut (each linear's output cotangent, mostly) are B's second output, kept until W. Values
computed from the residuals alone W recomputes (elementwise, unless --recompute left a layer's forward
to the backward, which W then repeats). Without recompute neither half repeats the other's matmuls,
so T_B + T_W is the fused backward's cost. Equations that compute both
kinds of grad at once (a `scan` or `cond` over layers) stay whole in B, which is still correct.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.extend.core import Literal

from jax3d.pipeline import residuals

_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")


def residual_mask(chunk, wc, x) -> list[bool]:
    """Which leaves of the chunk's pullback F stores (those that depend on x)."""
    return residuals.input_dependent(lambda w, x: jax.tree.leaves(jax.vjp(chunk, w, x)[1]), (wc, x), 1)


def forward(chunk, wc, x, mask):
    """F: (y, the residuals selected by mask)."""
    y, pullback = jax.vjp(chunk, wc, x)
    return y, [a for a, keep in zip(jax.tree.leaves(pullback), mask) if keep]


def pullback(chunk, wc, zero_x, mask, stored):
    """The chunk's pullback with stored residuals; the zero-input forward traced here is dead code."""
    return residuals.rebuild(jax.vjp(chunk, wc, zero_x)[1], mask, stored)


def backward(chunk, wc, zero_x, mask, stored, ct):
    """Fused backward: (weight grads, input grad)."""
    return pullback(chunk, wc, zero_x, mask, stored)(ct)


def _sub_jaxpr(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())


def _read(env, v):
    """A jaxpr variable's value: a literal's own, else what `env` holds."""
    return v.val if isinstance(v, Literal) else env[v]


def _eval(eqns, env):
    """Evaluate equations in order into env (var -> value), inlining calls and checkpoints."""
    for eqn in eqns:
        vals = [_read(env, v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            jaxpr, consts = sub
            inner = dict(zip(jaxpr.constvars, consts))
            inner.update(zip(jaxpr.invars, vals))
            _eval(jaxpr.eqns, inner)
            outs = [_read(inner, v) for v in jaxpr.outvars]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)  # older JAX: a pair
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *vals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return env


def _needed(eqns, outvars):
    """Indices of the equations that the outvars depend on."""
    live = {v for v in outvars if not isinstance(v, Literal)}
    keep = set()
    for n in range(len(eqns) - 1, -1, -1):
        if any(v in live for v in eqns[n].outvars):
            keep.add(n)
            live.update(v for v in eqns[n].invars if not isinstance(v, Literal))
    return keep


@dataclasses.dataclass(frozen=True)
class Split:
    """The pullback cut into B (input grad) and W (weight grads), over one traced jaxpr."""

    jaxpr: object
    consts: list
    b_eqns: list
    w_eqns: list
    cut: list  # vars B computes and W reads
    grad_tree: object  # treedef of the weight grads

    def _env(self, leaves, ct):
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, list(leaves) + [ct]))
        return env

    def cut_avals(self):
        return [v.aval for v in self.cut]

    def b(self, leaves, ct):
        """B: (input grad, what W reads from it)."""
        env = self._env(leaves, ct)
        _eval(self.b_eqns, env)
        return _read(env, self.jaxpr.outvars[-1]), [env[v] for v in self.cut]

    def w(self, leaves, ct, cut):
        """W: the weight grads from the residuals, the output grad and B's cut values."""
        env = self._env(leaves, ct)
        env.update(zip(self.cut, cut))
        _eval(self.w_eqns, env)
        outs = [_read(env, v) for v in self.jaxpr.outvars[:-1]]
        return jax.tree.unflatten(self.grad_tree, outs)


def split(chunk, wc, zero_x, mask, stored, ct) -> Split:
    """Trace the rebuilt pullback once and cut it into B and W (see the module docstring)."""
    pb = pullback(chunk, wc, zero_x, mask, stored)
    leaves, tree = jax.tree.flatten(pb)
    grad_tree = jax.tree.structure(jax.eval_shape(lambda: pb(ct)[0]))

    def flat(leaves, ct):
        dw, dx = jax.tree.unflatten(tree, leaves)(ct)
        return jax.tree.leaves(dw) + [dx]

    def inlined(leaves, ct):
        closed = jax.make_jaxpr(flat)(leaves, ct)
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, list(leaves) + [ct]))
        _eval(closed.jaxpr.eqns, env)
        return [_read(env, v) for v in closed.jaxpr.outvars]

    closed = jax.make_jaxpr(inlined)(leaves, ct)
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        raise ValueError("the chunk's pullback closes over traced values it does not take as residuals")
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    in_b = _needed(eqns, jaxpr.outvars[-1:])
    in_w = _needed(eqns, jaxpr.outvars[:-1]) - in_b
    # Values B computes from the residuals alone (a layer's forward, recomputed inside the backward under
    # --recompute, or a layer norm's normalised input) are recomputed by W too rather than kept across
    # the cut: the cut then holds cotangents only, and recompute saves memory in ZB-H1 as it does in 1F1B.
    from_ct = {jaxpr.invars[-1]}
    for eqn in eqns:
        if any(not isinstance(v, Literal) and v in from_ct for v in eqn.invars):
            from_ct.update(eqn.outvars)
    defined_in_b = {v for n in in_b for v in eqns[n].outvars}
    wanted = [v for n in sorted(in_w) for v in eqns[n].invars] + list(jaxpr.outvars[:-1])
    wanted = [v for v in wanted if not isinstance(v, Literal) and v in defined_in_b]
    in_w |= _needed(eqns, [v for v in wanted if v not in from_ct])
    defined_in_w = {v for n in in_w for v in eqns[n].outvars}
    cut, seen = [], set()
    for n in sorted(in_w):
        for v in eqns[n].invars:
            if not isinstance(v, Literal) and v in defined_in_b and v not in defined_in_w and v not in seen:
                seen.add(v)
                cut.append(v)
    for v in jaxpr.outvars[:-1]:  # a weight grad B computes whole
        if not isinstance(v, Literal) and v in defined_in_b and v not in defined_in_w and v not in seen:
            seen.add(v)
            cut.append(v)
    return Split(jaxpr, list(closed.consts), [eqns[n] for n in sorted(in_b)], [eqns[n] for n in sorted(in_w)], cut,
                 grad_tree)

