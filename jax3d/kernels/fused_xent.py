"""The LM loss's softmax cross-entropy over a chunk of logits as one Pallas (Triton) kernel, for one GPU.

XLA reads a chunk's logits three times before it writes their gradient: for the row maximum, for the
sum of exponentials and the target's logit, and for the gradient itself. Here one program takes a block
of rows and reads each row twice: once for a running (online) maximum, sum of exponentials and target
logit, and once more to write the gradient: softmax minus one-hot, times the token's loss weight.

The maths is `layers.token_nll`'s: fp32 throughout, columns from `valid` on (the vocabulary's padding)
left out of the softmax, with a zero gradient.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import block_width, check_powers_of_two, compiler_params, fields

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Rows per program, columns per step of its loop over the vocabulary, and warps."""

    rows: int = 1
    block: int = 4096
    warps: int = 8

    def __post_init__(self):
        check_powers_of_two(self, *fields(self))


DEFAULT = Tuning()


def supported(rows: int, tuning: Tuning = DEFAULT) -> bool:
    """Whether `token_nll` takes logits of `rows` tokens: in whole row blocks."""
    return rows % tuning.rows == 0


def _kernel(logits_ref, target_ref, weight_ref, nll_ref, *grad_ref, width: int, valid: int, block: int):
    target = target_ref[...][:, None]
    rows = target.shape[0]

    def load(j):
        """Columns [j * block, (j + 1) * block) in fp32, those past `valid` read as -inf."""
        cols = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        x = pltriton.load(logits_ref.at[:, pl.ds(j * block, block)], mask=cols < valid, other=-jnp.inf)
        return x.astype(F32), cols

    def stats(j, carry):
        top, total, picked = carry
        x, cols = load(j)
        new_top = jnp.maximum(top, jnp.max(x, axis=1, keepdims=True))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(x - new_top), axis=1, keepdims=True)
        picked = picked + jnp.sum(jnp.where((cols == target) & (cols < width), x, 0.0), axis=1, keepdims=True)
        return new_top, total, picked

    steps = pl.cdiv(width, block)
    zeros = jnp.zeros((rows, 1), F32)
    # The maximum starts finite: from -inf, a first block of masked columns would rescale by exp(-inf + inf).
    top, total, picked = jax.lax.fori_loop(0, steps, stats, (zeros + jnp.finfo(F32).min, zeros, zeros))
    lse = top + jnp.log(total)
    nll_ref[...] = (lse - picked)[:, 0]
    if grad_ref:
        weight = weight_ref[...].astype(F32)[:, None]

        def write(j, carry):
            x, cols = load(j)
            grad = (jnp.exp(x - lse) - jnp.where(cols == target, 1.0, 0.0)) * weight
            out = grad_ref[0].at[:, pl.ds(j * block, block)]
            pltriton.store(out, grad.astype(out.dtype), mask=cols < width)
            return carry

        jax.lax.fori_loop(0, steps, write, 0)


def token_nll(logits, targets, weights, valid: int = 0, grad_dtype=None, tuning: Tuning = DEFAULT,
              interpret: bool = False):
    """Each token's negative log-likelihood (fp32, the shape of `targets`) and, with `grad_dtype`, the
    gradient of sum(nll * weights) with respect to the logits, in that dtype (else None).

    `valid` (0: all) is the number of real vocabulary columns. Not differentiable itself: the caller
    that wants gradients asks for them here. `interpret=True` runs in Pallas' interpreter (for tests).
    """
    width = logits.shape[-1]
    lead = targets.shape
    logits2 = logits.reshape(-1, width)
    n = logits2.shape[0]
    rows = tuning.rows
    if n % rows:
        raise ValueError(f"{n} tokens of logits do not split into blocks of {rows} rows; see fused_xent.supported")
    padded = block_width(width)  # the kernel masks the tail
    row_block = pl.BlockSpec((rows, padded), lambda i: (i, 0))
    per_row = pl.BlockSpec((rows,), lambda i: (i,))
    out_shape = [jax.ShapeDtypeStruct((n,), F32)]
    out_specs = [per_row]
    if grad_dtype is not None:
        out_shape.append(jax.ShapeDtypeStruct((n, width), grad_dtype))
        out_specs.append(row_block)
    out = pl.pallas_call(
        functools.partial(_kernel, width=width, valid=min(valid or width, width), block=min(tuning.block, padded)),
        grid=(n // rows,),
        in_specs=[row_block, per_row, per_row],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(tuning.warps, interpret),
        interpret=interpret,
        name="fused_xent",
    )(logits2, targets.reshape(n).astype(jnp.int32), weights.reshape(n).astype(F32))
    nll = out[0].reshape(lead)
    return nll, (out[1].reshape(logits.shape) if grad_dtype is not None else None)


def reference(logits, targets, weights, valid: int = 0, grad_dtype=None):
    """What `token_nll` computes, in plain JAX."""
    logits = logits.astype(F32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if valid:
        logits = jnp.where(vocab < valid, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    hit = vocab == targets[..., None]
    nll = lse - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    grad = (jnp.exp(logits - lse[..., None]) - hit) * weights.astype(F32)[..., None]
    return nll, (grad.astype(grad_dtype) if grad_dtype is not None else None)


register("fused_xent", Tuning, DEFAULT, supported, token_nll, reference)
