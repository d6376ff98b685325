"""GEMMs of a single row (generation's decode at batch 1) with the row repeated twice.

A vector-matrix dot whose operands hold fewer than 10M elements is rewritten by XLA's GPU compiler into a
multiply and a sum: a fusion that writes the whole weight-sized product, then a sum that reads it back. With the
row repeated twice (a broadcast, which XLA fuses into the GEMM's operand) the dot is a matrix product, goes to a
GEMM and reads the weight once; the first row of its output is the answer; decode at batch 1 ran faster on one
H100 (docs/decode.md, docs/performance.md). The decode spec on a GPU (cached_attention.decode_spec) runs the
attention's out-projection and the blocks' GEMMs through it; below the bound are gpt-1.3b's
out-projection and Llama-3.2-1B's QKV and out-projections. Batched decode has more rows and is untouched.
jax3d's Generator at batch 1 on a GPU keeps its weights as rows, whose one-row products are reductions
(jax3d.inference.generate.as_rows), which this leaves as they are.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax3d.models import quantized


# XLA's bound: a vector-matrix dot with fewer elements in its operands together becomes a multiply and a sum
REWRITTEN_BELOW = 10_000_000


def gemm(dot, x_bt, w):
    """`dot(x_bt, w)` for an `x_bt` of (batch, seq, ...) whose result is (batch, seq, ...); with one row
    (batch * seq == 1) and operands below XLA's bound, computed on the row repeated twice. For GPUs: above the
    bound XLA keeps the one row's dot a GEMM itself, and the CPU has no such rewrite (there the second row slowed
    decode: the decode spec uses this on GPUs only). A Quantized weight's one row is a reduction of jax3d's own
    (jax3d.models.quantized.dot), so it keeps its one row."""
    if (x_bt.shape[0] * x_bt.shape[1] != 1 or x_bt.size + w.size >= REWRITTEN_BELOW
            or isinstance(w, quantized.Quantized)):
        return dot(x_bt, w)
    return dot(jnp.broadcast_to(x_bt, (1, 2) + x_bt.shape[2:]), w)[:, :1]
