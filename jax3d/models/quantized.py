"""Weights stored in fp8 for generation: each GEMM weight of the blocks, and the vocabulary tables, as e4m3
values with one scale per output column (a vocabulary row), dequantized inside the GEMM.

Decoding reads every weight once per step, so at small batches a step's time is its weights' bytes. Stored in
e4m3 they are half of bf16's. The GEMM converts the values to the compute dtype as it loads them (XLA fuses
the convert into its GEMM's operand: compiled for an H100, the fusion reads the f8 weight itself) and its
output is multiplied by the scale, a vector over the output columns, which XLA fuses into the GEMM's epilogue
or the split-K reduction after it. Of one row (decode at batch 1) the product is a row reduction instead: the
values are stored with each output column's weights together, and the reduction reads them once (`dot`).

A column's scale is its largest magnitude over the contracted dims divided by e4m3's largest value (448), so
the largest element of each column is stored exactly and every other one to e4m3's 3-bit mantissa (within
2**-4 of itself, relative) down to 2**-6 / 448 of the column's largest; below that e4m3's subnormals round it to
a multiple of 2**-9 / 448 of the largest. Training never sees these: only jax3d.inference.Generator builds them
(`weight_dtype`), and a checkpoint keeps its bf16 or fp32 weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn


# The weights generation keeps in fp8 and the dims each one's GEMM contracts (jax3d.models.layers): the blocks'
# GEMMs, and the word embedding and untied output table, which the LM head contracts over `embed` (a scale per
# vocabulary row, which the embedding's lookup applies to its row too). Their other dims are the output columns,
# which get one scale each.
CONTRACTED = {"qkv_kernel": (0,), "out_kernel": (0, 1), "up_kernel": (0,), "down_kernel": (0,),
              "word": (1,), "output": (1,)}


def stored_order(ndim: int, contracted: tuple) -> tuple:
    """A weight's dims in the order its Quantized values store them: the output columns', then the contracted."""
    return tuple(i for i in range(ndim) if i not in contracted) + tuple(contracted)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight as `values` (in fp8) and `scale` (its output columns' shape: its shape without the `contracted`
    dims, in the weight's own dtype); the weight is values * scale, broadcast over the contracted dims. The values
    are stored with the contracted dims last (`order`), so that each output column's weights lie together: one
    row's product is then a row reduction that reads each weight once (`dot`). With `scale` None the values are
    the weight itself, in its own dtype, only stored so (`quantize` with dtype None)."""

    values: jax.Array
    scale: jax.Array | None
    contracted: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def order(self) -> tuple:
        """The weight's dims in the order `values` stores them: the output columns', then the contracted ones."""
        return stored_order(self.values.ndim, self.contracted)

    @property
    def shape(self):
        """The weight's own shape (not the stored one)."""
        return tuple(self.values.shape[self.order.index(i)] for i in range(self.values.ndim))

    @property
    def size(self):
        return self.values.size

    def unstored(self, dtype=None):
        """The values in the weight's own dim order (a transpose XLA folds into the GEMM), converted to `dtype` if
        given."""
        values = jnp.transpose(self.values, tuple(np.argsort(self.order)))
        return values if dtype is None else values.astype(dtype)


def quantize(w, contracted: tuple, dtype=E4M3) -> Quantized:
    """`w` as fp8 `dtype` values with one scale per output column (w's dims but the `contracted` ones), in w's
    dtype; with `dtype` None, w's own values stored column by column, without a scale."""
    if dtype is None:
        return Quantized(jnp.transpose(w, stored_order(w.ndim, contracted)), None, tuple(contracted))
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contracted)
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, 1.0).astype(w.dtype)  # an all-zero column keeps zeros
    values = jnp.clip(w32 / jnp.expand_dims(scale.astype(jnp.float32), contracted), -largest, largest).astype(dtype)
    return Quantized(jnp.transpose(values, stored_order(w.ndim, contracted)), scale, tuple(contracted))


def dequantize(w: Quantized, dtype=jnp.float32):
    """The weight `w` stands for, in `dtype`: the reference its GEMMs are tested against."""
    return _scaled(w.unstored(jnp.float32), w, w.contracted).astype(dtype)


def _scaled(y, w: Quantized, at: tuple = ()):
    """`y` (values of `w`, or a product's output columns) times w's scale, expanded at dims `at`; as it is for a
    weight without a scale."""
    return y if w.scale is None else y * jnp.expand_dims(w.scale.astype(y.dtype), at)


def dot(fn, x, w):
    """`fn(x, w)` for a GEMM `fn` that contracts x's last dims with w's contracted ones (in their order) and ends
    its output in w's output columns. With `w` Quantized: of one row (x holds one row's worth), a row reduction
    over the stored values, in fp32; of more rows, `fn` on the values converted to x's dtype; either scaled after.

    XLA's GEMM of one row and fp8 weights read them far below the copy rate on an H100 (its autotuner picked one
    pipeline stage and no TMA for gpt-1.3b's QKV and up shapes: docs/decode.md); a row reduction reads each
    column's contiguous weights once."""
    if not isinstance(w, Quantized):
        return fn(x, w)
    k = len(w.contracted)
    row = w.values.shape[w.values.ndim - k:]
    if x.size == math.prod(row):
        out = jax.eval_shape(fn, x, jax.ShapeDtypeStruct(w.shape, x.dtype))
        products = w.values.astype(jnp.float32) * x.reshape(row).astype(jnp.float32)
        y = jnp.sum(products, axis=tuple(range(w.values.ndim - k, w.values.ndim)))
        return _scaled(y, w).astype(out.dtype).reshape(out.shape)
    return _scaled(fn(x, w.unstored(x.dtype)), w)


def einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)`, for a Quantized `w` too (its output columns last in the result)."""
    return dot(functools.partial(jnp.einsum, spec), x, w)


def take(table, ids):
    """Rows `ids` of a (vocab, embed) table (`jnp.take` on axis 0), of a Quantized one in its scale's dtype."""
    if not isinstance(table, Quantized):
        return jnp.take(table, ids, axis=0)
    rows = jnp.take(table.unstored(), ids, axis=0)
    if table.scale is None:
        return rows
    return rows.astype(table.scale.dtype) * jnp.take(table.scale, ids, axis=0)[..., None]


def rounded(params: dict, compute_dtype=None) -> dict:
    """A model's parameters (the train state's logical tree, blocks stacked over layers) with each of CONTRACTED's
    weights replaced by the values its fp8 form stands for, in its own dtype: what generation's fp8 GEMMs multiply
    by, to evaluate. `compute_dtype` is the one generation places the weights in before quantizing (None: theirs);
    an e4m3 value times its bf16 scale is exact in fp32."""
    def one(path, w):
        contracted = CONTRACTED.get(path[-1].key)
        if contracted is None:
            return w
        def back(a):
            return dequantize(quantize(a.astype(compute_dtype or a.dtype), contracted), w.dtype)
        return jax.vmap(back)(w) if path[0].key == "blocks" else back(w)
    return jax.tree_util.tree_map_with_path(one, params)


def quantize_params(params: dict, dtype=E4M3) -> dict:
    """Parameters (nested dicts: a layer, or the embedding and head) with CONTRACTED's weights Quantized (dtype
    None: stored column by column, unscaled)."""
    return {k: quantize_params(v, dtype) if isinstance(v, dict) else
            quantize(v, CONTRACTED[k], dtype) if k in CONTRACTED else v for k, v in params.items()}
