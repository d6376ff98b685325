"""The QKV projection's bias and its split into q, k and v, with the backward pass as one Pallas (Triton)
kernel, for one GPU.

Forward, (y + b) is sliced into q, k and v, the three dense arrays the fused attention kernel reads (XLA
fuses the bias into the slices). Backward, attention hands back dq, dk and dv, and the GEMMs that follow
want them as one (batch, seq, 3, heads, head_dim) array: XLA wrote that concatenate and the bias gradient,
a column sum over every token, in one slow fusion (docs/performance.md, "Kernel notes"). The kernel reads
each of dq, dk and dv once, writes its third of the concatenate, and leaves per-program partial sums of
the bias gradient in fp32, which XLA adds up (a few MB).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import check_powers_of_two, compiler_params, fields

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block shapes and warps (powers of two). Each program walks rows_per_program tokens of one strip of
    columns of dq, dk or dv, rows at a time; the strip is `cols` wide, or the largest power of two that
    divides heads * head_dim if that is narrower."""

    cols: int = 1024
    rows: int = 4
    rows_per_program: int = 128
    warps: int = 4

    def __post_init__(self):
        check_powers_of_two(self, *fields(self))
        if self.rows_per_program < self.rows:
            raise ValueError(f"fused_qkv.{self}: rows_per_program must be at least rows")

    def strip(self, width: int) -> int:
        """The strip width for q, k and v of `width` (heads * head_dim) columns."""
        return math.gcd(width, self.cols)

    def fits(self, tokens: int, width: int) -> bool:
        """Whether q, k and v of [tokens, width] split into whole blocks."""
        return tokens > 0 and width > 0 and tokens % self.rows_per_program == 0 and self.strip(width) >= 16


DEFAULT = Tuning()


def supported(y, tuning: Tuning = DEFAULT) -> bool:
    """Whether `split_bias` takes this (batch, seq, 3, heads, head_dim) projection."""
    if y.ndim != 5 or y.shape[2] != 3:
        return False
    b, t, _, n, h = y.shape
    return tuning.fits(b * t, n * h)


def reference(y, b):
    """What `split_bias` computes, in plain JAX."""
    qkv = y + b.astype(y.dtype)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _bwd_kernel(dq_ref, dk_ref, dv_ref, dy_ref, db_ref, *, strips: int, steps: int, rows_per_step: int):
    """One program: a strip of one of dq, dk, dv (program_id 1 counts the strips of all three in turn)."""

    def copy_and_sum(src_ref):
        def step(i, db):
            rows = pl.ds(i * rows_per_step, rows_per_step)
            x = src_ref[rows, :]
            dy_ref[rows, :] = x
            return db + jnp.sum(x.astype(F32), axis=0)

        db = jax.lax.fori_loop(0, steps, step, jnp.zeros((db_ref.shape[1],), F32))
        db_ref[...] = db[None, :]

    which = pl.program_id(1) // strips
    jax.lax.switch(which, [functools.partial(copy_and_sum, r) for r in (dq_ref, dk_ref, dv_ref)])


def _backward(dq, dk, dv, tuning: Tuning, interpret: bool):
    """dq, dk, dv: [tokens, width]. -> (their concatenate [tokens, 3 * width], its column sums in fp32)."""
    tokens, width = dq.shape
    if not tuning.fits(tokens, width):
        raise ValueError(f"split_bias: q, k and v of [{tokens}, {width}] do not split into the blocks of "
                         f"{tuning}; see fused_qkv.supported")
    cols, strip_rows = tuning.strip(width), tuning.rows_per_program
    strips = width // cols
    src = pl.BlockSpec((strip_rows, cols), lambda i, j: (i, j % strips))
    dy, db = pl.pallas_call(
        functools.partial(_bwd_kernel, strips=strips, steps=strip_rows // tuning.rows, rows_per_step=tuning.rows),
        grid=(tokens // strip_rows, 3 * strips),
        in_specs=[src, src, src],
        out_specs=[pl.BlockSpec((strip_rows, cols), lambda i, j: (i, j)),
                   pl.BlockSpec((1, cols), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((tokens, 3 * width), dq.dtype),
                   jax.ShapeDtypeStruct((tokens // strip_rows, 3 * width), F32)],
        compiler_params=compiler_params(tuning.warps, interpret),
        interpret=interpret,
        name="fused_qkv_bwd",
    )(dq, dk, dv)
    return dy, db.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def split_bias(y, b, tuning: Tuning = DEFAULT, interpret: bool = False):
    """(q, k, v) of y + b, y of (batch, seq, 3, heads, head_dim) and b of (3, heads, head_dim), each of
    (batch, seq, heads, head_dim) in y's dtype. Reverse-mode only (a custom vjp); keeps only b for the
    backward pass. `interpret=True` runs the kernel in Pallas' interpreter, on any backend (for tests)."""
    return _fwd(y, b, tuning, interpret)[0]


def _fwd(y, b, tuning, interpret):
    if b.shape != y.shape[2:]:
        raise ValueError(f"split_bias: the bias has shape {b.shape}; it must be {y.shape[2:]}, one per "
                         "(q/k/v, head, head_dim) of the projection")
    qkv = y + b.astype(y.dtype)
    return (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), b  # b for its dtype only


def _bwd(tuning, interpret, res, d):
    dq, dk, dv = d
    bsz, t, n, h = dq.shape
    flat = [a.reshape(bsz * t, n * h) for a in (dq, dk, dv)]
    dy, db = _backward(*flat, tuning, interpret)
    return dy.reshape(bsz, t, 3, n, h), db.reshape(3, n, h).astype(res.dtype)


split_bias.defvjp(_fwd, _bwd)


register("fused_qkv", Tuning, DEFAULT, supported, split_bias, reference)
