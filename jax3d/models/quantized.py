"""Weights stored in fp8 for generation: each GEMM weight of the blocks as e4m3 values with one scale per
output column, dequantized inside the GEMM.

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

# The blocks' GEMM weights and how many of their leading dims each GEMM contracts (jax3d.models.layers): the
# rest are its output columns, which get one scale each.
CONTRACTED = {"qkv_kernel": 1, "out_kernel": 2, "up_kernel": 1, "down_kernel": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight as `values` (its shape, in fp8) and `scale` (its output columns' shape: values.shape[c:] for
    the c contracted dims, in fp32); the weight is values * scale."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.values.shape

    @property
    def size(self):
        return self.values.size


def quantize(w, contracted: int, dtype=E4M3) -> Quantized:
    """`w` as fp8 `dtype` values with one fp32 scale per output column (its dims after the first `contracted`)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(contracted)))
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, 1.0)  # an all-zero column keeps zeros under any scale
    values = jnp.clip(w32 / scale, -largest, largest).astype(dtype)
    return Quantized(values, scale)


def weight_dtype(flag: str):
    """The blocks' GEMM weights' dtype for `--quantization flag` (None: the compute dtype)."""
    return QUANTIZATIONS[flag]


def dequantize(w: Quantized, dtype=jnp.float32):
    """The weight `w` stands for, in `dtype`: the reference its GEMMs are tested against."""
    return (w.values.astype(jnp.float32) * w.scale).astype(dtype)


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


def quantize_layer(layer: dict, dtype=E4M3) -> dict:
    """One block's parameters (nested dicts) with its GEMM weights (CONTRACTED's names) Quantized."""
    return {k: quantize_layer(v, dtype) if isinstance(v, dict) else
            quantize(v, CONTRACTED[k], dtype) if k in CONTRACTED else v for k, v in layer.items()}
