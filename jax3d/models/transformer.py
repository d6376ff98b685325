"""The shared transformer LM: embedding, stacked blocks, head. GPT and BERT differ only in their ends.

Parameters form one pytree:
    {'embed': {...}, 'blocks': {... each leaf (layers, ...)}, 'final_norm': {...}, 'head': {...}}
Blocks are stacked on a leading `layers` dim, so pipeline stages slice them without a model change, and
the step runs them in an unrolled loop (or `lax.scan` with `scan_layers`, which compiles faster for deep
models but ran slower on GPU).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d import dropout_keys
from jax3d.config import ModelConfig
from jax3d.kernels.policy import KernelPolicy
from jax3d.models.layers import Block
from jax3d.models.spec import block_spec
from jax3d.parallel.rules import ShardingRules

_POLICIES = {
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def unbox(tree):
    return nn.meta.unbox(tree)


def logical_axes_of(boxed_tree):
    """Logical axis names of every leaf of a boxed (with_logical_partitioning) parameter tree."""
    return jax.tree.map(lambda b: tuple(b.names) if isinstance(b, nn.LogicallyPartitioned) else (None,) * b.ndim,
                        boxed_tree, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def layer_rng(rng, layer: int | jax.Array):
    """Dropout key of one layer (per sample, given a batch of keys): the same derivation whether layers
    run in one loop or across stages."""
    return None if rng is None else dropout_keys.fold_in(rng, layer)


def unstack_layers(blocks, num: int) -> list:
    """Per-layer parameter trees of a stack, for an unrolled loop over layers.

    One `split` per leaf: its gradient is one concatenate. Indexing `a[i]` per layer instead gives each
    layer a gradient padded with zeros to the whole stack, and the step then adds up `num` such stacks
    (slower: docs/performance.md).
    """
    parts = jax.tree.map(lambda a: [s[0] for s in jnp.split(a, num)], blocks)
    return [jax.tree.map(lambda _, ps: ps[i], blocks, parts) for i in range(num)]


class TransformerLM:
    """Base of GPT and BERT: `kernels` (the run's KernelPolicy) and `fp8` (the FP8 recipe's format, "" for none)
    choose the blocks' parts (jax3d.models.spec). Subclasses define the ends: `_modules`, `_init_ends`,
    `sample_shapes`, `embed`, `head_loss`, `normalizers` (and `block_mask` when blocks take a mask)."""

    causal = True

    def __init__(self, cfg: ModelConfig, rules: ShardingRules | None = None, *,
                 kernels: KernelPolicy | None = None, fp8: str = ""):
        self.cfg = cfg
        self.rules = rules if rules is not None else ShardingRules.inactive()
        self.kernels = kernels if kernels is not None else KernelPolicy.none()  # no plan: the default backend's
        self.fp8 = fp8
        self.spec = block_spec(cfg, self.kernels, fp8)  # the blocks' parts, chosen once
        self.block = Block(cfg, self.rules, self.spec, causal=self.causal)

    # ---- parameters -------------------------------------------------------------------------
    def _dummy_x(self):
        return jnp.zeros((1, min(8, self.cfg.seq_length), self.cfg.hidden_size), jnp.float32)

    def _init_ends(self, rng) -> dict:
        raise NotImplementedError

    def _boxed_init(self, rng):
        r_ends, r_blocks = jax.random.split(rng)
        ends = self._init_ends(r_ends)
        keys = jax.random.split(r_blocks, self.cfg.num_layers)
        blocks = jax.vmap(lambda k: self.block.init(k, self._dummy_x())["params"])(keys)
        return {**ends, "blocks": blocks}

    def logical_axes(self):
        """Pytree of logical-axis tuples matching `init`'s output."""
        boxed = jax.eval_shape(self._boxed_init, jax.random.key(0))
        axes = logical_axes_of(boxed)
        axes["blocks"] = jax.tree.map(lambda a: ("layers",) + a, axes["blocks"],
                                      is_leaf=lambda a: isinstance(a, tuple))
        return axes

    def init(self, rng):
        """fp32 parameters. Jit it with `out_shardings` to create them already sharded."""
        return unbox(self._boxed_init(rng))

    def num_params(self) -> int:
        """Parameter count, read off the abstract parameter tree (nothing is allocated)."""
        return sum(math.prod(a.shape) for a in jax.tree.leaves(jax.eval_shape(self.init, jax.random.key(0))))

    # ---- forward ------------------------------------------------------------------------------
    def run_blocks(self, blocks, x, rng=None, deterministic=True, mask=None, keys=None):
        """Applies stacked blocks in order. Block i's dropout key is `layer_rng(rng, i)`, or `keys[i]` when
        a stack of keys is given (the pipeline derives them the same way); a key may be one typed key per
        row of x (jax3d.dropout_keys)."""
        num = jax.tree.leaves(blocks)[0].shape[0]

        def one(p, x, i):
            key = layer_rng(rng, i) if keys is None else keys[i]
            return self.block.apply({"params": p}, x, mask, key, deterministic)

        if self.cfg.recompute in _POLICIES:
            one = jax.checkpoint(one, policy=_POLICIES[self.cfg.recompute])
        if self.cfg.scan_layers:
            def body(x, pi):
                p, i = pi
                return one(p, x, i), None
            x, _ = jax.lax.scan(body, x, (blocks, jnp.arange(num)))
            return x
        for i, p in enumerate(unstack_layers(blocks, num)):
            x = one(p, x, i)
        return x

    def embed(self, params, mb, rng=None, deterministic=True):
        raise NotImplementedError

    def head_loss(self, params, x, mb) -> tuple[dict, dict]:
        """(loss sums per term, other sums such as correct predictions) of one micro-batch."""
        raise NotImplementedError

    def normalizers(self, batch) -> dict:
        """What each loss term's sum is divided by, counted over a whole batch (any leading dims).

        They depend on the batch only, never on the parameters, so the step counts them up front and
        every micro-batch's objective is already its exact share of the global-batch loss.
        """
        raise NotImplementedError

    def block_mask(self, mb):
        """Attention mask passed to every block (None for causal LM)."""
        return None

    def objective(self, params, x, mb, norms):
        """Head, loss terms and their normalised sum: the scalar that is differentiated."""
        sums, aux = self.head_loss(params, x, mb)
        return sum(sums[k] / norms[k] for k in sums), {**{f"{k}_sum": v for k, v in sums.items()}, **aux}

    def loss(self, params, mb, rng=None, deterministic=True, norms=None):
        """(objective, aux sums) of one micro-batch, sequentially through all blocks.

        Without `norms` the micro-batch is its own batch, and the objective is its mean loss. `rng` is one
        key, or one typed key per row of the micro-batch (jax3d.dropout_keys), which the train step gives.
        """
        norms = self.normalizers(mb) if norms is None else norms
        x = self.embed(params, mb, layer_rng(rng, self.cfg.num_layers), deterministic)
        x = self.run_blocks(params["blocks"], x, rng, deterministic, self.block_mask(mb))
        return self.objective(params, x, mb, norms)
