"""Where each logical layer lives in the pipeline, and the dropout key derivation.

The caller stacks layer parameters in logical order 0..L-1. The pipeline shards the stacked dim on
`stage` in contiguous blocks, so it wants them in *pipeline order*: stage s holds chunks
c = 0..v-1, and chunk c on stage s is virtual stage c*p + s, which runs logical layers
offset[c*p + s] ... in order. Every virtual stage is padded to the largest layer count k, so the
pipeline-ordered stack has p*v*k rows; padded rows are zeros, skipped (run as identity) by a mask,
and get zero gradients. Params stored in pipeline order therefore keep zero padding under any
optimizer whose update of a zero param with zero gradient is zero (SGD, Adam(W), weight decay).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax3d import dropout_keys


class PipelineError(ValueError):
    """The pipeline cannot run with the arguments given."""


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Layer placement for p stages with v chunks each.

    rows: (p, v, k) int array, the logical layer run at each position, -1 for padding.
    """

    stages: int
    virtual_stages: int
    num_layers: int
    rows: np.ndarray

    @property
    def layers_per_chunk(self) -> int:
        return int(self.rows.shape[2])

    @property
    def padded(self) -> bool:
        return bool((self.rows < 0).any())

    @property
    def is_identity(self) -> bool:
        """True when pipeline order is logical order (no permutation, no padding)."""
        return not self.padded and bool((self.rows.reshape(-1) == np.arange(self.num_layers)).all())


def make_layout(num_layers: int, stages: int, virtual_stages: int = 1,
                layers_per_virtual_stage=None) -> LayerLayout:
    """Build a layout. Without `layers_per_virtual_stage` the layers split evenly and must divide
    by stages * virtual_stages; with it (a list of p*v counts in virtual-stage order, like Megatron's
    --pipeline-model-parallel-layout) each virtual stage runs that many consecutive layers."""
    p, v = stages, virtual_stages
    if layers_per_virtual_stage is None:
        if num_layers % (p * v):
            raise PipelineError(
                f"{num_layers} layers do not split evenly over {p} stages x {v} virtual stages; "
                f"pass layers_per_virtual_stage with {p * v} counts")
        counts = [num_layers // (p * v)] * (p * v)
    else:
        counts = [int(c) for c in layers_per_virtual_stage]
        if len(counts) != p * v or sum(counts) != num_layers or min(counts) < 0:
            raise PipelineError(
                f"layers_per_virtual_stage {counts} must have {p * v} non-negative counts "
                f"summing to {num_layers} layers")
    k = max(max(counts), 1)
    rows = np.full((p, v, k), -1, dtype=np.int32)
    offset = np.concatenate([[0], np.cumsum(counts)])
    for vs, n in enumerate(counts):
        rows[vs % p, vs // p, :n] = np.arange(offset[vs], offset[vs] + n)
    return LayerLayout(p, v, num_layers, rows)


def state_layout(pipeline, num_layers: int) -> LayerLayout | None:
    """The layout a train state stores its `num_layers` layers in under `pipeline` (a PipelineSpec), or None
    when that is logical order (no pipeline, or one whose layout is the identity)."""
    if not pipeline.pipelined:
        return None
    layout = make_layout(num_layers, pipeline.stages, pipeline.virtual_stages, pipeline.layer_counts)
    return None if layout.is_identity else layout


def to_pipeline_order(stacked, layout: LayerLayout):
    """Permute (and pad with zero rows) a stacked-layer pytree from logical order to pipeline order.

    Costs one gather of every stacked leaf; when the stack is sharded on `stage` this moves all
    layers that change stage. Store params in pipeline order to avoid it each step."""
    if layout.is_identity:
        return stacked
    flat = layout.rows.reshape(-1)
    idx, real = np.maximum(flat, 0), flat >= 0

    def reorder(a):
        rows = jnp.take(a, idx, axis=0)
        if real.all():
            return rows
        return jnp.where(real.reshape((-1,) + (1,) * (a.ndim - 1)), rows, jnp.zeros((), a.dtype))
    return jax.tree.map(reorder, stacked)


def from_pipeline_order(stacked, layout: LayerLayout):
    """Inverse of to_pipeline_order: drop padding rows and restore logical layer order."""
    if layout.is_identity:
        return stacked
    flat = layout.rows.reshape(-1)
    pos = np.empty(layout.num_layers, dtype=np.int32)
    pos[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
    return jax.tree.map(lambda a: jnp.take(a, pos, axis=0), stacked)


def dropout_key(rng, microbatch, layer):
    """The dropout key of one (micro-batch, logical layer): fold_in(fold_in(rng, mb), layer). With one
    key per sample (rng shaped (micro-batches, rows)), the micro-batch's row of keys, each folded with
    the layer.

    A sequential reference that derives keys this way sees the same randomness as the pipeline."""
    if dropout_keys.is_per_sample(rng, 2):
        return dropout_keys.fold_in(jax.lax.dynamic_index_in_dim(rng, microbatch, 0, keepdims=False), layer)
    return jax.random.fold_in(jax.random.fold_in(rng, microbatch), layer)


def layer_keys(rng, microbatch, layers):
    """Keys for a run of logical layers (int array), stacked on a leading dim: (layers,), or (layers, rows)
    with one key per sample."""
    return jax.vmap(lambda l: dropout_key(rng, microbatch, l))(jnp.asarray(layers))
