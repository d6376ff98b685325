"""The blocks' GEMMs as 2-D products, and the product of one row by a weight matrix on a GPU (decode at batch 1).

Every GEMM of the blocks is an einsum "x,w->y" whose x is its batch dims then the contracted ones, w the
contracted ones then its outputs ("btd,dcnh->btcnh"): (T, K) x (K, N) -> (T, N) on reshapes that move no data
(`layout`, `sizes`). jax3d.models.fp8 runs its FP8 GEMMs on that view.

One row (T = 1, a decode step at batch 1): XLA's GPU compiler rewrites a dot of which one operand is a vector,
and whose operands hold fewer than 10M elements together, into a multiply and a sum (its DotStrengthReduction
pass), and the multiply, in the dot's output type, is a fusion of its own: it writes the whole (K, N) product
to memory and the sum reads it back, three times the weight's bytes. At the gpt-1.3b shape that is the
attention's out-projection (2048 x 2048), 16 MB more per layer and token; at smaller widths, every GEMM of the
block. `einsum` writes such a product as the multiply and sum in fp32, with the row written first, which XLA
compiles to one reduction that reads the weight once (benchmarks/gpu_compile.py, docs/decode.md).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax3d.parallel.rules import traced_platform

# XLA's bound (operand elements, the two together) below which a dot with a vector operand is rewritten
REWRITTEN_BELOW = 10_000_000


def layout(spec: str) -> tuple[int, int, int] | None:
    """(batch dims of x, contracted dims, w's output dims) of a spec "x,w->y" whose x is its batch dims then
    the contracted ones, w the contracted ones then its outputs, y x's batch dims then w's outputs, each
    dimension named once; None for another."""
    ins, y = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    if not (x + w).isalpha() or len(set(x)) < len(x) or len(set(w)) < len(w):
        return None
    contracted = "".join(c for c in x if c in w)
    nb, nc = len(x) - len(contracted), len(contracted)
    if x[nb:] != contracted or w[:nc] != contracted or y != x[:nb] + w[nc:]:
        return None
    return nb, nc, len(w) - nc


def fits(spec_layout, x_shape, w_shape) -> bool:
    """Whether x and w have the spec's dimensions, the contracted ones of equal sizes (else the einsum says
    what is wrong)."""
    nb, nc, no = spec_layout
    return len(x_shape) == nb + nc and len(w_shape) == nc + no and tuple(x_shape[nb:]) == tuple(w_shape[:nc])


def sizes(spec_layout, x_shape, w_shape) -> tuple[int, int, int]:
    """(T, K, N) of the GEMM's 2-D view."""
    nb, nc, _ = spec_layout
    return math.prod(x_shape[:nb]), math.prod(x_shape[nb:]), math.prod(w_shape[nc:])


def einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)`; on a GPU, one row by a matrix that XLA would rewrite (see above) is
    `row_product`'s multiply and sum."""
    spec_layout = layout(spec)
    if spec_layout is not None and fits(spec_layout, x.shape, w.shape) and _on_gpu():
        t, k, n = sizes(spec_layout, x.shape, w.shape)
        if t == 1 and k + k * n < REWRITTEN_BELOW:
            return row_product(spec_layout, x, w)
    return jnp.einsum(spec, x, w)


def row_product(spec_layout, x, w):
    """The product of x, one row, by w, summed in fp32 and given in x's dtype."""
    nb, nc, _ = spec_layout
    _, k, n = sizes(spec_layout, x.shape, w.shape)
    # x is written first: XLA otherwise fused x's producer (the attention's softmax and context) and the
    # multiply into one kernel that wrote the whole fp32 product for the sum to read.
    x = jax.lax.optimization_barrier(x)
    y_n = jnp.sum(x.reshape(k, 1).astype(jnp.float32) * w.reshape(k, n).astype(jnp.float32), axis=0)
    return y_n.astype(x.dtype).reshape(x.shape[:nb] + w.shape[nc:])


def _on_gpu() -> bool:
    return traced_platform() == "gpu"
