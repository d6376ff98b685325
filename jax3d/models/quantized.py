"""Weights stored in fp8 for generation: each GEMM weight of the blocks, and the vocabulary tables, as e4m3
values with one scale per output column (a vocabulary row), dequantized inside the GEMM.

Decoding reads every weight once per step, so at small batches a step's time is its weights' bytes. Stored in
e4m3 they are half of bf16's. The GEMM converts the values to the compute dtype as it loads them (XLA fuses
the convert into its GEMM's operand: compiled for an H100, the fusion reads the f8 weight itself) and its
output is multiplied by the scale, a vector over the output columns, which XLA fuses into the GEMM's epilogue
or the split-K reduction after it.

A column's scale is its largest magnitude over the contracted dims divided by e4m3's largest value (448), so
the largest element of each column is stored exactly and every other one to e4m3's 3-bit mantissa (within
2**-4 of itself, relative) down to 2**-6 / 448 of the column's largest; below that e4m3's subnormals round it to
a multiple of 2**-9 / 448 of the largest. Training never sees these: only jax3d.inference.Generator builds them
(`weight_dtype`), and a checkpoint keeps its bf16 or fp32 weights.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn

QUANTIZATIONS = {"none": None, "fp8": E4M3}  # --quantization: None keeps the compute dtype

# The weights generation keeps in fp8 and the dims each one's GEMM contracts (jax3d.models.layers): the blocks'
# GEMMs, and the word embedding and untied output table, which the LM head contracts over `embed` (a scale per
# vocabulary row, which the embedding's lookup applies to its row too). Their other dims are the output columns,
# which get one scale each.
CONTRACTED = {"qkv_kernel": (0,), "out_kernel": (0, 1), "up_kernel": (0,), "down_kernel": (0,),
              "word": (1,), "output": (1,)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight as `values` (its shape, in fp8) and `scale` (its output columns' shape: its shape without the
    contracted dims, in the weight's own dtype), `contracted` those dims; the weight is values * scale, broadcast
    over them."""

    values: jax.Array
    scale: jax.Array
    contracted: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.values.shape

    @property
    def size(self):
        return self.values.size


def quantize(w, contracted: tuple, dtype=E4M3) -> Quantized:
    """`w` as fp8 `dtype` values with one scale per output column (w's dims but the `contracted` ones), in w's
    dtype."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contracted)
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, 1.0).astype(w.dtype)  # an all-zero column keeps zeros
    values = jnp.clip(w32 / jnp.expand_dims(scale.astype(jnp.float32), contracted), -largest, largest).astype(dtype)
    return Quantized(values, scale, contracted)


def weight_dtype(flag: str):
    """The dtype generation keeps CONTRACTED's weights in for `--quantization flag` (None: the compute dtype)."""
    return QUANTIZATIONS[flag]


def dequantize(w: Quantized, dtype=jnp.float32):
    """The weight `w` stands for, in `dtype`: the reference its GEMMs are tested against."""
    return (w.values.astype(jnp.float32) * jnp.expand_dims(w.scale.astype(jnp.float32), w.contracted)).astype(dtype)


def dot(fn, x, w):
    """`fn(x, w)` for a GEMM `fn` whose output ends in w's output columns; with `w` Quantized, on its values
    converted to x's dtype, and the output scaled."""
    if not isinstance(w, Quantized):
        return fn(x, w)
    y = fn(x, w.values.astype(x.dtype))
    return y * w.scale.astype(y.dtype)


def einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)`, for a Quantized `w` too (its output columns last in the result)."""
    return dot(functools.partial(jnp.einsum, spec), x, w)


def take(table, ids):
    """Rows `ids` of a (vocab, embed) table (`jnp.take` on axis 0), of a Quantized one in its scale's dtype."""
    if not isinstance(table, Quantized):
        return jnp.take(table, ids, axis=0)
    rows = jnp.take(table.values, ids, axis=0).astype(table.scale.dtype)
    return rows * jnp.take(table.scale, ids, axis=0)[..., None]


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
    """Parameters (nested dicts: a layer, or the embedding and head) with CONTRACTED's weights Quantized."""
    return {k: quantize_params(v, dtype) if isinstance(v, dict) else
            quantize(v, CONTRACTED[k], dtype) if k in CONTRACTED else v for k, v in params.items()}
