"""Dropout keys, one key or one per sample.

The trainer gives every sample of a step its own key, `sample_keys(step_key, ids)` with each sample's
index in the global batch, and derives a layer's key from it by `fold_in` and a sublayer's by `split`.
A sample's dropout masks then depend on the sample alone, not on which micro-batch, data shard or
pipeline stage computes it, so every layout trains on the same masks. These helpers take either a single
key or such a batch of keys (a key array with one leading dim) and act per sample on the latter.
"""
from __future__ import annotations

import jax


def is_per_sample(rng, dims: int = 1) -> bool:
    """Whether `rng` is typed keys, one per sample, with `dims` leading dims ((rows,), or (micro-batches,
    rows) for a whole step), rather than one key."""
    return (rng is not None and getattr(rng, "ndim", 0) == dims
            and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key))


def sample_keys(rng, ids):
    """One key per sample: `rng` folded with each of `ids` (int array, any shape; the keys take its shape)."""
    return jax.vmap(lambda i: jax.random.fold_in(rng, i))(ids.reshape(-1)).reshape(ids.shape)


def fold_in(rng, data):
    """`jax.random.fold_in`, per sample when `rng` is a batch of keys."""
    if is_per_sample(rng):
        return jax.vmap(lambda k: jax.random.fold_in(k, data))(rng)
    return jax.random.fold_in(rng, data)


def split(rng, num: int):
    """`jax.random.split` into `num`; per sample when `rng` is a batch of keys (then `num` rows of
    batches)."""
    if is_per_sample(rng):
        return jax.vmap(lambda k: jax.random.split(k, num), out_axes=1)(rng)
    return jax.random.split(rng, num)


def bernoulli(rng, p: float, shape: tuple):
    """`jax.random.bernoulli` over `shape`; per sample when `rng` is a batch of keys (each key draws
    `shape[1:]`, and `shape[0]` is the batch)."""
    if is_per_sample(rng):
        return jax.vmap(lambda k: jax.random.bernoulli(k, p, shape[1:]))(rng)
    return jax.random.bernoulli(rng, p, shape)
