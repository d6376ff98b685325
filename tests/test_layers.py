"""The layers as a Flax user calls them: no sharding rules or mesh, dropout from Flax's 'dropout' stream."""
import jax
import jax.numpy as jnp
import numpy as np

from jax3d.models import Block, Embedding
from jax3d.parallel import ShardingRules
from tests.helpers import tiny_model


def test_dropout_follows_flax_rngs_and_an_explicit_rng_wins():
    cfg = tiny_model(hidden_dropout=0.1, attention_dropout=0.1)
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.hidden_size))
    block = Block(cfg)  # the default rules: no mesh in context, so no constraint
    v = block.init(jax.random.key(0), x)
    same_model = Block(cfg, ShardingRules.inactive())
    np.testing.assert_array_equal(block.apply(v, x), same_model.apply(v, x))

    det = block.apply(v, x, deterministic=False)  # no key at all: no dropout
    np.testing.assert_array_equal(det, block.apply(v, x))
    a = block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    assert float(jnp.abs(a - det).max()) > 1e-3
    np.testing.assert_array_equal(a, block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)}))
    assert float(jnp.abs(a - block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(4)})).max()) > 1e-3
    np.testing.assert_array_equal(det, block.apply(v, x, deterministic=True, rngs={"dropout": jax.random.key(3)}))

    explicit = block.apply(v, x, None, jax.random.key(5), False)
    np.testing.assert_array_equal(explicit, block.apply(v, x, None, jax.random.key(5), False,
                                                        rngs={"dropout": jax.random.key(3)}))

    emb = Embedding(cfg)
    tokens = jnp.arange(32).reshape(2, 16) % cfg.vocab_size
    ev = emb.init(jax.random.key(0), tokens)
    assert float(jnp.abs(emb.apply(ev, tokens, deterministic=False, rngs={"dropout": jax.random.key(3)})
                         - emb.apply(ev, tokens)).max()) > 1e-3
