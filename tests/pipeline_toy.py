"""A toy layer-stacked language model for pipeline tests and memory reports.

Tied embedding -> L residual MLP blocks (hidden dim sharded on `model`) -> norm -> tied head ->
cross-entropy. Small enough for CPU, shaped like the real thing: first_fn / stage_fn / last_fn over
shared and stacked params, plus the sequential reference the pipeline must match.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax3d import dropout_keys
from jax3d.pipeline.layout import layer_keys
from jax3d.pipeline.loop import pipeline_value_and_grad

DROPOUT = 0.1


def init(key, *, vocab=32, d=16, hidden=32, layers=8):
    """(stacked, shared) params in float32."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    stacked = {"w1": jax.random.normal(k1, (layers, d, hidden)) / jnp.sqrt(d),
               "w2": jax.random.normal(k2, (layers, hidden, d)) / jnp.sqrt(hidden)}
    shared = {"embed": jax.random.normal(k3, (vocab, d)),
              "scale": 1.0 + 0.1 * jax.random.normal(k4, (d,))}
    return stacked, shared


def param_shardings(mesh, stage=True):
    """Stacked layers on `stage` (unless `stage` is False: a logical stack of uneven layers does not
    divide), MLP hidden dim on `model`, shared params replicated."""
    st = "stage" if stage else None
    stacked = {"w1": NamedSharding(mesh, P(st, None, "model")),
               "w2": NamedSharding(mesh, P(st, "model", None))}
    shared = {"embed": NamedSharding(mesh, P()), "scale": NamedSharding(mesh, P())}
    return stacked, shared


def microbatches(key, *, m, batch, seq, vocab=32):
    """{'tokens', 'targets'}, each (m, batch, seq) int32."""
    tok = jax.random.randint(key, (m, batch, seq + 1), 0, vocab)
    return {"tokens": tok[..., :-1], "targets": tok[..., 1:]}


def first_fn(shared, mb, key=None):
    return shared["embed"][mb["tokens"]]  # (batch, seq, d)


def stage_fn(layers, x, keys, mb=None):
    for j in range(layers["w1"].shape[0]):  # unrolled: chunks are short
        h = jnp.tanh(jnp.einsum("bsd,dh->bsh", x, layers["w1"][j]))
        h = jax.lax.with_sharding_constraint(h, P(None, None, "model"))
        if keys is not None:
            keep = dropout_keys.bernoulli(keys[j], 1.0 - DROPOUT, h.shape)  # one key, or one per row
            h = jnp.where(keep, h / (1.0 - DROPOUT), 0.0)
        x = x + jnp.einsum("bsh,hd->bsd", h, layers["w2"][j])
    return x


def last_fn(shared, x, mb):
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * shared["scale"]
    logits = jnp.einsum("bsd,vd->bsv", x, shared["embed"])  # tied head
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, mb["targets"][..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, -1) == mb["targets"]).astype(jnp.float32)
    return jnp.sum(nll), {"correct": jnp.sum(correct), "tokens": jnp.float32(nll.size)}


def sequential_loss(stacked, shared, mbs, rng=None):
    """Reference: every micro-batch through all layers in order; (loss_sum, aux_sums)."""
    m = mbs["tokens"].shape[0]
    n = stacked["w1"].shape[0]
    loss, aux = 0.0, None
    for i in range(m):
        mb = jax.tree.map(lambda a: a[i], mbs)
        keys = None if rng is None else layer_keys(rng, i, jnp.arange(n))
        l, a = last_fn(shared, stage_fn(stacked, first_fn(shared, mb), keys), mb)
        loss = loss + l
        aux = a if aux is None else jax.tree.map(jnp.add, aux, a)
    return loss, aux


def pipelined(mesh, schedule, **kw):
    """jit of pipeline_value_and_grad for the toy model on `mesh`: f(stacked, shared, mbs, rng)."""
    uneven_logical = kw.get("layers_per_virtual_stage") and not kw.get("params_in_pipeline_order")
    st_sh, sh_sh = param_shardings(mesh, stage=not uneven_logical)
    mb_sh = NamedSharding(mesh, P(None, "data"))

    def fn(stacked, shared, mbs, rng=None):
        return pipeline_value_and_grad(first_fn, stage_fn, last_fn, stacked, shared, mbs,
                                       mesh=mesh, schedule=schedule, rng=rng, **kw)
    rep = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(st_sh, sh_sh, {"tokens": mb_sh, "targets": mb_sh}, rep))


def compile_memory(mesh, schedule, *, m, batch=16, seq=256, d=128, hidden=256, layers=8, vocab=256):
    """Compile the toy pipeline ahead of time from abstract shapes; returns memory_analysis()."""
    st, sh = jax.eval_shape(lambda: init(jax.random.key(0), vocab=vocab, d=d, hidden=hidden,
                                         layers=layers))
    mbs = jax.eval_shape(lambda: microbatches(jax.random.key(0), m=m, batch=batch, seq=seq,
                                              vocab=vocab))
    with jax.set_mesh(mesh):
        return pipelined(mesh, schedule).lower(st, sh, mbs, None).compile().memory_analysis()
